"""A GGUF whose header claims what its file does not hold fails at once, in one line that names
the field or tensor; one whose claims cost more than the context served loads and answers.

First the cases one by one, each with the message it gets: a layer count past the layers present,
shape fields the tensors contradict, a special token past the vocabulary, a tensor retyped or past
the end of the file, a cut file (named before any tokenizer is built from it), and a count of more
items than the file can hold. All mutate one item of ``agentd.model.synth``'s tiny Q8_0 file (the
default model's tokenizer, 2 layers, 20 tensors, 16 MB) in place and put it back. (A context
claim no tensor carries, 2^32 - 1 tokens, loads: tests/model/test_rope_table.py.)

Then the fuzz: every numeric item of that header is located (the version and counts, each scalar
metadata value and array length, each tensor's dimension count, dims, type and offset) and set,
one at a time, to what a broken converter or a hostile file holds: 0, 1, off by one, doubled, the
type's largest value, NaN and infinities for floats; and the file is cut at points in its header
and data. A sample covers every item of the metadata and every part of a tensor entry (about 300
mutants; the seed is fixed). One worker process (this file run as a script, under an address-space
limit so that a runaway mutant cannot take the machine) loads each mutant with the offline API,
``agentd.LLM(path)``, and generates greedy tokens. The mutant is written into the file in place
and the file's mtime put back, so the tokenizer cached for the file is reused (the tokenizer's
own metadata is not what is under test here; its ids are, by the header check). A mutant passes
if it fails with a one-line ``ModelLoadError`` within ``FAIL_BOUND_S`` (a bound on hangs, ~50x the
header check's time on the 2-core machine, not a speed claim), or loads and answers: finite
hidden states, every token in the vocabulary, and, for items no forward reads, the unmutated
file's very tokens (or, for a context too short for the prompt, the engine's one-line refusal).
The worker's peak RSS (VmHWM) stays under 1 GiB.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

FAIL_BOUND_S = 5.0
MAX_RSS_BYTES = 2**30
ADDRESS_SPACE_BYTES = 16 * 2**30  # the worker's RLIMIT_AS: torch alone reserves a few GiB
SEED = 33
NUM_TENSOR_MUTANTS = 160
PROMPT = [19556, 665, 28, 638, 359, 314, 253, 1345]
MAX_TOKENS = 4
# Items no forward reads: mutants of these that load must give the unmutated tokens.
NO_OP_ITEMS = ("general.", "tokenizer.ggml.", "llama.context_length", "llama.vocab_size",
               "llama.rope.dimension_count")

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_TENSOR_TYPE_IDS = (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30, 99)


@dataclass(frozen=True)
class Item:
    """One numeric item of the header: where it lies and what it holds."""

    label: str  # "llama.block_count", "blk.0.attn_q.weight.offset", "header.tensor_count", ...
    kind: str  # header, metadata, array_length, n_dims, dim, type, offset
    pos: int
    code: str  # struct code
    value: Any


@dataclass(frozen=True)
class Mutant:
    label: str
    kind: str
    pos: int  # -1: a cut of the file at ``value`` bytes
    code: str
    value: Any


def header_items(data: bytes) -> tuple[list[Item], int]:
    """Every numeric item of a GGUF header, and where the header ends."""
    items: list[Item] = []
    pos = 4

    def take(code: str, label: str | None = None, kind: str = "") -> Any:
        nonlocal pos
        value = struct.unpack_from("<" + code, data, pos)[0]
        if label is not None:
            items.append(Item(label, kind, pos, code, value))
        pos += struct.calcsize("<" + code)
        return value

    def text() -> str:
        nonlocal pos
        length = take("Q")
        pos += length
        return data[pos - length:pos].decode()

    take("I", "header.version", "header")
    num_tensors = take("Q", "header.tensor_count", "header")
    num_fields = take("Q", "header.kv_count", "header")
    for _ in range(num_fields):
        key, value_type = text(), take("I")
        if value_type in _SCALARS:
            take(_SCALARS[value_type], key, "metadata")
        elif value_type == 8:
            text()
        else:
            item_type, count = take("I"), take("Q", f"{key}.length", "array_length")
            for _ in range(count):
                take(_SCALARS[item_type]) if item_type in _SCALARS else text()
    for _ in range(num_tensors):
        name = text()
        num_dims = take("I", f"{name}.n_dims", "n_dims")
        for d in range(num_dims):
            take("Q", f"{name}.ne{d}", "dim")
        take("I", f"{name}.type", "type")
        take("Q", f"{name}.offset", "offset")
    return items, pos


def _int_values(item: Item) -> list[int]:
    bits = 8 * struct.calcsize(item.code)
    signed = item.code.islower()
    top = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
    v = item.value
    values = [0, 1, v - 1, v + 1, 2 * v, top, min(2**30, top)]
    if signed:
        values += [-1, -(2 ** (bits - 1))]
    return [x for x in values if x != v and (signed or x >= 0) and x <= top]


def mutations(item: Item, file_bytes: int) -> list[Any]:
    """What a broken or hostile file would hold in ``item``'s place (for items the model code
    does not read, three values: such mutants load, and a load costs ~0.6 s)."""
    if item.code == "?":
        return [not item.value]
    if item.label.startswith(("general.", "tokenizer.")):
        return [x for x in _int_values(item) if x in (0, item.value + 1, max(_int_values(item)))]
    if item.code in "fd":
        return [0.0, -item.value, math.nan, math.inf, -math.inf, 2 * item.value, 1e30]
    if item.kind == "type":
        return [t for t in _TENSOR_TYPE_IDS if t != item.value]
    if item.kind == "n_dims":
        return [t for t in (0, 1, 2, 3, 5, 2**31) if t != item.value]
    if item.kind == "offset":
        return [x for x in (item.value + 32, item.value + 1, item.value - 32, file_bytes,
                            2**40, 2**64 - 1) if x >= 0]
    return _int_values(item)


def all_mutants(data: bytes) -> list[Mutant]:
    """Every mutation of every metadata and header item, a sample of the tensor entries' (each
    kind of part covered), and cuts of the file."""
    items, header_end = header_items(data)
    rng = random.Random(SEED)
    whole = [Mutant(i.label, i.kind, i.pos, i.code, v) for i in items
             if i.kind in ("header", "metadata", "array_length")
             for v in mutations(i, len(data))]
    tensor_part = [Mutant(i.label, i.kind, i.pos, i.code, v) for i in items
                   if i.kind not in ("header", "metadata", "array_length")
                   for v in mutations(i, len(data))]
    sample = rng.sample(tensor_part, NUM_TENSOR_MUTANTS)
    for kind in ("n_dims", "dim", "type", "offset"):  # every kind, whatever the draw
        sample += [m for m in tensor_part if m.kind == kind][:1]
    cuts = [Mutant("cut", "cut", -1, "", n) for n in
            (header_end // 2, header_end - 8, header_end + 64, (header_end + len(data)) // 2,
             len(data) - 1)]
    return whole + sample + cuts


# ------------------------------------------------------------------ the worker (this file, run)

def _apply(path: Path, original: bytes, mutant: Mutant | None) -> None:
    """Write ``mutant`` into the file (None: the original), keeping its size and mtime when it
    can (so the tokenizer cached for the file stays its own)."""
    stat = path.stat()
    with path.open("r+b") as f:
        if mutant is None:
            f.write(original)
        elif mutant.pos < 0:
            f.truncate(mutant.value)
        else:
            f.seek(mutant.pos)
            f.write(struct.pack("<" + mutant.code, mutant.value))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _attempt(path: Path) -> dict[str, Any]:
    """Load ``path`` and answer one prompt: what happened, and how long it took."""
    import gc

    import torch

    from agentd import LLM, SamplingParams
    from agentd.model.load_errors import ModelLoadError

    started = time.monotonic()
    try:
        llm = LLM(str(path), kv_cache_memory="16MiB", speculative="off")
    except ModelLoadError as exc:
        return {"error": str(exc), "type": type(exc).__name__, "s": time.monotonic() - started}
    except BaseException as exc:  # noqa: BLE001 - an internal error is what the test reports
        return {"internal": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - started}
    finite: list[bool] = []
    model = llm.engine.loaded.model
    hook = model.register_forward_hook(lambda m, a, out: finite.append(bool(out.isfinite().all())))
    try:
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True))[0]
        result = {"tokens": out.token_ids, "finite": all(finite),
                  "vocab": model.dims.vocab_size}
    except ValueError as exc:  # the engine refusing a prompt the served context cannot hold
        result = {"refused": str(exc)}
    except BaseException as exc:  # noqa: BLE001
        result = {"internal": f"{type(exc).__name__} while answering: {exc}"}
    hook.remove()
    del llm, model
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


def worker(path: Path, mutants_file: Path) -> None:
    """Each mutant in turn, one JSON line each; the unmutated file first; peak RSS last."""
    mutants = [Mutant(**m) for m in json.loads(mutants_file.read_text())]
    original = path.read_bytes()
    print(json.dumps({"label": "original", **_attempt(path)}), flush=True)
    for mutant in mutants:
        _apply(path, original, mutant)
        try:
            result = _attempt(path)
        finally:
            _apply(path, original, None)
        print(json.dumps({**asdict(mutant), **result}), flush=True)
    from agentd.engine.kv_sizing import proc_status_bytes

    # VmHWM, not ru_maxrss: Linux keeps a process's ru_maxrss across exec, so a worker started
    # from a pytest process of 1.9 GiB reported 1.9 GiB before it loaded anything.
    print(json.dumps({"label": "peak", "rss_bytes": proc_status_bytes("VmHWM")}), flush=True)


if __name__ == "__main__":
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = ADDRESS_SPACE_BYTES if hard == resource.RLIM_INFINITY else \
        min(ADDRESS_SPACE_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    worker(Path(sys.argv[1]), Path(sys.argv[2]))


# ------------------------------------------------------------------ the cases, one by one

@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory) -> Path:
    from agentd.model.synth import write_synth_gguf

    path = tmp_path_factory.mktemp("gguf-header") / "tiny-q8.gguf"
    write_synth_gguf(path, "tiny", "Q8_0")
    return path


@contextmanager
def mutated(path: Path, label: str, value: Any) -> Iterator[Path]:
    """``path`` with one header item (or, for ``"cut"``, its length) set to ``value``; put back
    on exit."""
    original = path.read_bytes()
    if label == "cut":
        mutant = Mutant("cut", "cut", -1, "", value)
    else:
        item = {i.label: i for i in header_items(original)[0]}[label]
        mutant = Mutant(label, item.kind, item.pos, item.code, value)
    _apply(path, original, mutant)
    try:
        yield path
    finally:
        _apply(path, original, None)


def load_error(path: Path) -> str:
    """The one-line message loading ``path`` as it ships fails with."""
    from agentd.model.gguf_model import load_gguf_model
    from agentd.model.load_errors import ModelLoadError

    with pytest.raises(ModelLoadError) as excinfo:
        load_gguf_model(path)
    message = str(excinfo.value)
    assert message.startswith(f"{path.name}: ") and "\n" not in message, message
    return message


def test_a_layer_count_past_the_layers_held_is_named(tiny_q8: Path) -> None:
    # Before: 2^30 layers built on the meta device, memory growing while /health said loading.
    with mutated(tiny_q8, "llama.block_count", 2**30):
        message = load_error(tiny_q8)
    assert "llama.block_count claims 1,073,741,824 layers, but the file holds tensors of 2 " \
           "layers (blk.0 to blk.1)" in message
    assert message.endswith("the file is damaged or cut short: download or convert it again")


@pytest.mark.parametrize(("label", "value", "named"), [
    ("llama.embedding_length", 512,
     "llama.embedding_length claims 512, but token_embd.weight holds rows of 256"),
    ("llama.attention.head_count", 8,
     "llama.attention.head_count_kv 2 x head size 32 claims tensor blk.0.attn_k.weight is "
     "256 x 64, but the file holds 256 x 128"),
    ("llama.attention.head_count", 0, "llama.attention.head_count claims 0; it counts"),
    ("llama.attention.head_count_kv", 4,
     "claims tensor blk.0.attn_k.weight is 256 x 256, but the file holds 256 x 128"),
    ("llama.feed_forward_length", 1024,
     "llama.feed_forward_length 1024 claims tensor blk.0.ffn_gate.weight is 256 x 1024, but the "
     "file holds 256 x 512"),
    ("llama.vocab_size", 50000,
     "llama.vocab_size claims 50000 tokens, but token_embd.weight holds 49,152 tokens"),
    ("tokenizer.ggml.eos_token_id", 49152,
     "tokenizer.ggml.eos_token_id claims token 49152, but token_embd.weight holds 49,152 tokens"),
    ("llama.rope.freq_base", math.nan, "llama.rope.freq_base claims nan; it must be a number"),
])
def test_a_field_the_tensors_contradict_is_named(tiny_q8: Path, label: str, value: Any,
                                                 named: str) -> None:
    with mutated(tiny_q8, label, value):
        assert named in load_error(tiny_q8)


def test_a_retyped_tensor_is_named_with_what_its_type_would_hold(tiny_q8: Path) -> None:
    # Before: Q8_0 rows read as Q4_0 blocks loaded "ready", and every answer was NaN.
    with mutated(tiny_q8, "blk.0.attn_q.weight.type", 2):
        message = load_error(tiny_q8)
    assert "tensor blk.0.attn_k.weight claims offset 13,440,000 in the data, but " \
           "blk.0.attn_q.weight (256 x 256 Q4_0, 36,864 bytes) before it ends at 13,407,232" \
           in message
    with mutated(tiny_q8, "output_norm.weight.type", 1):  # the last tensor: no next one
        assert "the file holds 512 bytes after its last tensor, output_norm.weight (256 F16, " \
               "512 bytes), that no tensor claims" in load_error(tiny_q8)


def test_a_tensor_past_the_end_of_the_file_is_named(tiny_q8: Path) -> None:
    # Before: an offset past the end loaded, then failed in a kernel ("rows hold 0 bytes").
    with mutated(tiny_q8, "output_norm.weight.offset", 2**40):
        assert "tensor output_norm.weight claims offset 1,099,511,627,776 in the data" \
            in load_error(tiny_q8)
    with mutated(tiny_q8, "cut", 15_000_000):
        assert "tensor token_embd.weight (256 x 49152 Q8_0, 13,369,344 bytes) claims bytes " \
               "1,770,336 to 15,139,680, past the end of the 15,000,000-byte file" \
               in load_error(tiny_q8)


def test_a_count_past_the_end_of_the_file_is_refused_before_reading(tiny_q8: Path) -> None:
    with mutated(tiny_q8, "tokenizer.ggml.tokens.length", 2**62):
        assert "tokenizer.ggml.tokens (an array of strings) claims 4,611,686,018,427,387,904 " \
               "items of at least 8 bytes each, but only" in load_error(tiny_q8)
    with mutated(tiny_q8, "header.tensor_count", 2**64 - 1):
        assert "the tensor count claims 18,446,744,073,709,551,615 tensors" \
            in load_error(tiny_q8)


def test_a_cut_file_is_named_before_any_tokenizer_is_built_from_it(tiny_q8: Path) -> None:
    # Before: a shape error from inside torch (shape '[49152, -1]' is invalid), or, cut in
    # the header, "cannot read the tokenizer".
    from agentd import LLM
    from agentd.model.load_errors import ModelLoadError

    for size, named in ((1_000_000, "tokenizer.ggml.merges"),
                        (15_000_000, "past the end of the 15,000,000-byte file")):
        with mutated(tiny_q8, "cut", size), pytest.raises(ModelLoadError) as excinfo:
            LLM(str(tiny_q8), kv_cache_memory="16MiB")
        assert named in str(excinfo.value) and "tokenizer of" not in str(excinfo.value)


# ------------------------------------------------------------------ the fuzz


def _judge(line: dict[str, Any], reference: list[int]) -> str | None:
    """What is wrong with one mutant's outcome, or None."""
    if "internal" in line:
        return line["internal"]
    if "error" in line:
        message = line["error"]
        if not message or "\n" in message:
            return f"a {line['type']} of {message.count(chr(10)) + 1} lines: {message!r}"
        return None if line["s"] < FAIL_BOUND_S else f"failed only after {line['s']:.1f} s"
    if "refused" in line:  # a context too short for the prompt: the engine says so, per request
        message = line["refused"]
        return None if "max_model_len" in message and "\n" not in message else \
            f"refused the prompt with {message!r}"
    if not line["finite"]:
        return "loaded, and answered with non-finite hidden states"
    if not all(0 <= t < line["vocab"] for t in line["tokens"]) or \
            len(line["tokens"]) != MAX_TOKENS:
        return f"answered {line['tokens']}"
    if line["label"].startswith(NO_OP_ITEMS) and line["tokens"] != reference:
        return f"answered {line['tokens']}, not the unmutated file's {reference}"
    return None


def test_every_header_mutant_loads_and_answers_or_fails_at_once(tiny_q8: Path,
                                                                 tmp_path: Path) -> None:
    mutants = all_mutants(tiny_q8.read_bytes())
    mutants_file = tmp_path / "mutants.json"
    mutants_file.write_text(json.dumps([asdict(m) for m in mutants]))
    run = subprocess.run([sys.executable, __file__, str(tiny_q8), str(mutants_file)],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines and lines[-1]["label"] == "peak", \
        f"the worker died after {lines[-1] if lines else 'nothing'}:\n{run.stderr[-3000:]}"
    original, results, peak = lines[0], lines[1:-1], lines[-1]
    assert "tokens" in original and original["finite"], original
    problems = [f"{r['label']} = {r['value']!r}: {why}" for r in results
                if (why := _judge(r, original["tokens"])) is not None]
    assert not problems, f"{len(problems)} of {len(results)} mutants:\n" + "\n".join(problems)
    assert len(results) == len(mutants)
    assert peak["rss_bytes"] is not None and peak["rss_bytes"] < MAX_RSS_BYTES, \
        f"peak RSS {(peak['rss_bytes'] or 0) / 2**20:.0f} MiB"
    kinds = {r["kind"] for r in results}
    assert kinds == {"header", "metadata", "array_length", "n_dims", "dim", "type", "offset",
                     "cut"}
    assert any("tokens" in r for r in results) and any("error" in r for r in results)
