"""Triton kernels on a CUDA machine: correctness, decode bandwidth, and engine greedy equivalence.

    python benchmarks/kernels_gpu.py [--max-kv-gib 16] [--skip-engine]

1. Checks each Triton kernel (KV write, decode, prefill) against its torch reference on CUDA.
2. Times paged decode attention (``triton.testing.do_bench``, median) over batch x context and
   reports the bandwidth it achieves (bytes of K/V read + query/output + block table) next to a
   device-to-device copy measured in the same run, which is the practical roofline.
3. Runs the engine on the default model with ``attention_backend="triton"`` and checks that its
   greedy tokens equal ``transformers``' ``generate(do_sample=False)``.

Exits non-zero without a CUDA device or when a check fails. Finishes in a few minutes; the
decode table is printed last, so the engine check runs before it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 4096, 8192, 16384, 32768)
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three primary colors:",
    "Once upon a time, in a small village by the sea,",
]


@dataclass(frozen=True)
class DecodeShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    context: int
    time_us: float
    bandwidth_gbs: float
    fraction_of_copy: float


# --- 1. correctness ---------------------------------------------------------------------------


def _paged_pool(seq_lens: list[int], shape: DecodeShape, gen: torch.Generator):
    """A pool whose blocks are a random permutation, plus each sequence's block table."""
    blocks_per_seq = [-(-n // shape.block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    kv_cache = torch.randn(num_blocks, 2, shape.block_size, shape.num_kv_heads, shape.head_dim,
                           generator=gen, device="cuda").to(shape.dtype)
    order = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = order[used:used + n]
        used += n
    return kv_cache, table


def _max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / (1 + |expected|): the tests' atol = rtol bound in one number."""
    if actual.isnan().any():
        return float("nan")
    expected = expected.float()
    return float(((actual.float() - expected).abs() / (1 + expected.abs())).max())


def check_kernels() -> list[tuple[str, float, float]]:
    """(case, error, tolerance) for each kernel x dtype; write_kv's error is mismatched elements."""
    from agentd.kernels.decode_attention import (
        reference_decode_attention,
        triton_decode_attention,
    )
    from agentd.kernels.kv_write import reference_write_kv, triton_write_kv
    from agentd.kernels.prefill_attention import (
        reference_prefill_attention,
        triton_prefill_attention,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for shape in (DecodeShape(32, 8, 128, 16, dtype), DecodeShape(9, 3, 64, 32, dtype)):
            tag = f"{name} H{shape.num_heads}/{shape.num_kv_heads} d{shape.head_dim}"
            seq_lens = [1, 16, 200, 4999, 512]  # 4999 spans 10 split-K partitions
            kv_cache, table = _paged_pool(seq_lens, shape, gen)
            lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
            scale = shape.head_dim**-0.5

            key = torch.randn(7, shape.num_kv_heads, shape.head_dim, generator=gen,
                              device="cuda").to(dtype)
            value = torch.randn_like(key)
            slots = torch.randperm(kv_cache.shape[0] * shape.block_size, generator=gen,
                                   device="cuda")[:7]
            expected_pool = kv_cache.clone()
            reference_write_kv(key, value, expected_pool, slots)
            pool = kv_cache.clone()
            triton_write_kv(key, value, pool, slots)
            results.append((f"write_kv {tag}", float((pool != expected_pool).sum()), 0.0))

            query = torch.randn(len(seq_lens), shape.num_heads, shape.head_dim, generator=gen,
                                device="cuda").to(dtype)
            out = triton_decode_attention(query, kv_cache, table, lens, scale)
            ref = reference_decode_attention(query.float(), kv_cache.float(), table, lens, scale)
            results.append((f"decode {tag}", _max_error(out, ref), TOLERANCES[dtype]))

            chunks = [1, 16, 150, 300, 37]
            starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()],
                                  dtype=torch.int32, device="cuda")
            query = torch.randn(sum(chunks), shape.num_heads, shape.head_dim, generator=gen,
                                device="cuda").to(dtype)
            out = triton_prefill_attention(query, kv_cache, table, starts, lens, scale)
            ref = reference_prefill_attention(query.float(), kv_cache.float(), table, starts,
                                              lens, scale)
            results.append((f"prefill {tag}", _max_error(out, ref), TOLERANCES[dtype]))
    return results


# --- 2. decode bandwidth ----------------------------------------------------------------------


def copy_bandwidth_gbs(num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy: (read + write) bytes per second, the bandwidth a kernel can reach."""
    import triton

    x = torch.empty(num_bytes // 2, dtype=torch.float16, device="cuda").normal_()
    ms = triton.testing.do_bench(lambda: torch.empty_like(x).copy_(x), return_mode="median")
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def time_decode(batch: int, context: int, shape: DecodeShape, copy_gbs: float) -> DecodeRow:
    import triton

    from agentd.kernels.decode_attention import triton_decode_attention

    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.empty(num_blocks, 2, shape.block_size, shape.num_kv_heads, shape.head_dim,
                           dtype=shape.dtype, device="cuda").normal_()
    table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, shape.num_heads, shape.head_dim, device="cuda").to(shape.dtype)
    scale = shape.head_dim**-0.5
    ms = triton.testing.do_bench(
        lambda: triton_decode_attention(query, kv_cache, table, lens, scale), return_mode="median"
    )
    elem = kv_cache.element_size()
    kv_bytes = batch * context * 2 * shape.num_kv_heads * shape.head_dim * elem
    io_bytes = 2 * query.numel() * elem + table.numel() * table.element_size()
    gbs = (kv_bytes + io_bytes) / (ms * 1e-3) / 1e9
    return DecodeRow(batch, context, ms * 1e3, gbs, gbs / copy_gbs)


def bench_decode(shape: DecodeShape, max_kv_gib: float, copy_gbs: float) -> list[DecodeRow]:
    rows = []
    elem_bytes = torch.empty((), dtype=shape.dtype).element_size()
    per_token = 2 * shape.num_kv_heads * shape.head_dim * elem_bytes
    for batch in BATCHES:
        for context in CONTEXTS:
            if batch * context * per_token > max_kv_gib * 2**30:
                continue  # over the memory cap
            rows.append(time_decode(batch, context, shape, copy_gbs))
            torch.cuda.empty_cache()
    return rows


# --- 3. engine greedy equivalence -------------------------------------------------------------


def check_engine(max_tokens: int = 32) -> tuple[bool | None, str]:
    """Greedy tokens of our engine (Triton backend, fp32) against transformers on the same model.

    Returns (passed, report); passed is None when the engine cannot be imported (a skip).
    """
    try:
        from agentd import LLM, SamplingParams
        from agentd.model.loader import resolve_model
    except ImportError as exc:
        return None, f"SKIPPED: the engine is not importable ({exc}); kernels were still checked"
    try:
        llm = LLM(model=None, device="cuda", attention_backend="triton", dtype="float32")
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens))
    except Exception as exc:  # report whatever the engine raised, then go on to the benchmark
        return False, f"engine failed: {type(exc).__name__}: {exc}"
    engine_ids = [list(out.token_ids) for out in outputs]
    del llm
    torch.cuda.empty_cache()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(None).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    eos_config = model.generation_config.eos_token_id
    eos = {tokenizer.eos_token_id, *(eos_config if isinstance(eos_config, list) else [eos_config])}
    lines, all_match = [], True
    for prompt, ours in zip(PROMPTS, engine_ids, strict=True):
        enc = tokenizer(prompt, return_tensors="pt").to("cuda")
        with torch.no_grad():
            generated = model.generate(**enc, do_sample=False, max_new_tokens=max_tokens,
                                       pad_token_id=tokenizer.eos_token_id)
        theirs = generated[0, enc.input_ids.shape[1]:].tolist()
        match = _strip_eos(ours, eos) == _strip_eos(theirs, eos)
        all_match &= match
        if not match:
            lines.append(f"  MISMATCH {prompt!r}\n    ours:   {ours}\n    theirs: {theirs}")
    verdict = f"{len(PROMPTS)} prompts x {max_tokens} tokens: " + \
        ("all greedy tokens equal" if all_match else "tokens differ")
    return all_match, "\n".join([verdict, *lines])


def _strip_eos(token_ids: list[int], eos: set[int | None]) -> list[int]:
    ids = list(token_ids)
    while ids and ids[-1] in eos:
        ids.pop()
    return ids


# --- main -------------------------------------------------------------------------------------


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-kv-gib", type=float, default=16.0,
                        help="skip batch x context combos whose K/V exceeds this (GiB)")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine check")
    return parser.parse_args()


def _print_table(shape: DecodeShape, copy_gbs: float, rows: list[DecodeRow]) -> None:
    print(f"\nDecode attention, H={shape.num_heads} Hkv={shape.num_kv_heads} "
          f"D={shape.head_dim} block={shape.block_size} {shape.dtype}; "
          f"device copy {copy_gbs:,.0f} GB/s")
    print(f"{'batch':>6} {'context':>8} {'median us':>11} {'GB/s':>9} {'% of copy':>10}")
    for row in rows:
        print(f"{row.batch:>6} {row.context:>8} {row.time_us:>11.1f} {row.bandwidth_gbs:>9,.0f} "
              f"{100 * row.fraction_of_copy:>9.1f}%")


def main() -> int:
    args = _parse_args()
    if not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA device; none is visible (torch.cuda.is_available() is "
              "False). Run it on a GPU machine.", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: pip install 'agentd[triton]'", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}")

    failures = 0
    print("\n[checks] kernels against their references")
    for case, error, tol in check_kernels():
        ok = error <= tol  # NaN compares False: a NaN output fails
        failures += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {case:<32} err {error:.2e} (tol {tol:.0e})")

    print("\n[engine] greedy equivalence with transformers (fp32, Triton backend)")
    if args.skip_engine:
        print("  skipped (--skip-engine)")
    else:
        engine_ok, message = check_engine()
        failures += engine_ok is False
        print("  " + message.replace("\n", "\n  "))

    print("\n[decode] timing (the table comes last)")
    dtype = getattr(torch, args.dtype)
    shape = DecodeShape(args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, dtype)
    copy_gbs = copy_bandwidth_gbs()
    rows = bench_decode(shape, args.max_kv_gib, copy_gbs)
    _print_table(shape, copy_gbs, rows)
    if failures:
        print(f"\n{failures} check(s) failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
