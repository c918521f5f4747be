"""GGUFs served as they ship (``--weights gguf``): the file's blocks, memory-mapped, multiplied by
agentd.kernels.cpu.

- Tiny random GGUFs written here from tiny transformers models (F32 blocks, so only the layout is
  under test: llama's permuted q/k rows with interleaved rotary, qwen2's biases, qwen3's q/k norms
  and wide heads) must give transformers' logits and greedy tokens.
- The synth helper's tiny Q4_K_M file loads by default as gguf, generates, and holds no float copy
  of any weight (every block a view of the mapping).
- The default model (Q4_1 linears, Q8_0 tied embedding) with ``--weights gguf`` against the exact
  fp32 conversion (which tests/model/test_equivalence.py and test_loader.py hold equal to
  transformers): greedy tokens identical, logits within what int8 activation rounding explains.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from torch import nn

from agentd.config import EngineConfig
from agentd.engine.kv_sizing import proc_status_bytes
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.kernels import cpu as ggml
from agentd.llm import LLM
from agentd.model import default_model, gguf_convert
from agentd.model.build import LoadedModel, eos_token_ids
from agentd.model.default_model import default_gguf_path
from agentd.model.ggml_linear import QUANT_MODULES, QuantEmbedding, QuantLinear
from agentd.model.gguf_index import GgufFile, lock_memory
from agentd.model.gguf_model import load_gguf_model
from agentd.model.llama import RotaryEmbedding, pack_linears, rope_inv_freq
from agentd.model.loader import (
    ModelConfig,
    ModelFiles,
    ModelLoadError,
    load_tokenizer,
    resolve_model,
)
from agentd.model.synth import SHAPES, write_synth_gguf

QT = gguf.GGMLQuantizationType
POOL_BYTES = 16 * 2**20
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY
        ) -> list[list[int]]:
    """Every prompt to completion in one batch; the generated ids, in prompt order."""
    ids = [engine.add_request(EngineRequest(p, params)) for p in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return [out[rid] for rid in ids]


class HiddenRecorder:
    """The final hidden states of every forward (before the LM head)."""

    def __init__(self, model: nn.Module) -> None:
        self.hidden: list[torch.Tensor] = []
        self.remove = model.register_forward_hook(
            lambda m, a, out: self.hidden.append(out.detach().clone())).remove


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps ``path`` (``/proc/self/maps``)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def assert_no_float_copy(model: nn.Module, path: Path) -> None:
    """Every block tensor is uint8 inside the file's memory mapping; no float tensor of the model
    has the size of a linear weight (norms, biases and the rotary table are all it holds)."""
    ranges = mapped_ranges(path)
    assert ranges
    linear_sizes, num_blocks = set(), 0
    for module in model.modules():
        if not isinstance(module, QUANT_MODULES):
            continue
        for weight in module.buffers(recurse=False):
            if weight.dtype == torch.uint8:
                begin, end = weight.data_ptr(), weight.data_ptr() + weight.numel()
                assert any(lo <= begin and end <= hi for lo, hi in ranges)
                num_blocks += 1
        if isinstance(module, QuantEmbedding):
            linear_sizes.add(module.num_embeddings * module.embedding_dim)
        else:
            linear_sizes.add(module.in_features * module.out_features)
    num_layers = len(model.layers)
    assert num_blocks == 2 + 7 * num_layers  # embedding, head, 3 + 1 + 2 + 1 parts per layer
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in model.modules())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not name.startswith("rotary."):
            assert tensor.numel() not in linear_sizes, name


def test_rotary_on_interleaved_pairs_is_rotate_half_under_the_file_permutation() -> None:
    rotary = RotaryEmbedding(ModelConfig({"model_type": "llama"}), 8, 32)
    x = torch.randn(5, 3, 8)  # tokens, heads, head dim
    # llama.cpp's order: row 2i + j of a head is transformers' row j * D/2 + i
    order = torch.arange(8).reshape(2, 4).t().reshape(8)
    table = rotary.table(torch.arange(5) * 3, torch.float32)
    (half,) = RotaryEmbedding.apply(table, x)
    (pairs,) = RotaryEmbedding.apply_interleaved(table, x[..., order])
    assert torch.equal(pairs, half[..., order])


def test_rope_freqs_divide_the_frequencies_as_llama_cpp_applies_them() -> None:
    # Llama 3.x files carry their rope scaling as rope_freqs.weight: theta_i / factor_i
    plain = ModelConfig({"model_type": "llama", "rope_theta": 500000.0})
    scaled = ModelConfig({"model_type": "llama", "rope_theta": 500000.0,
                          "rope_freq_factors": [1.0, 1.0, 2.5, 8.0]})
    base, _ = rope_inv_freq(plain, 8)
    inv_freq, scaling = rope_inv_freq(scaled, 8)
    torch.testing.assert_close(inv_freq, base / torch.tensor([1.0, 1.0, 2.5, 8.0]))
    assert scaling == 1.0


# ---------------------------------------------------------------- tiny GGUFs from transformers

_LAYER_TENSORS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                  "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                  "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                  "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TENSORS[module]}.{kind}"


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """transformers' q/k rows in llama.cpp's order (each head's rotary halves interleaved)."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]) \
        .swapaxes(1, 2).reshape(rows.shape)


def write_gguf(model: transformers.PreTrainedModel, path: Path) -> Path:
    """The model's weights as an F32 GGUF laid out as llama.cpp's converter lays them out."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    arch = "llama" if c.model_type in ("llama", "mistral") else c.model_type
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    for name, tensor in model.state_dict().items():
        rows = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            rows = _permute(rows, c.num_attention_heads if ".q_proj." in name
                            else c.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(rows))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def engine_over(path: Path, tokenizer_dir: Path) -> LLMEngine:
    """An engine over the GGUF's own blocks, with the tokenizer of ``tokenizer_dir`` (these
    files carry none; load_model's path is tested on the synth and default models below)."""
    served = load_gguf_model(path)
    files = ModelFiles(tokenizer_dir, path.stem, str(path), gguf=path)
    tokenizer = load_tokenizer(files)
    loaded = LoadedModel(files, served.config, tokenizer, served.model, torch.device("cpu"),
                         torch.float32, path.stem, eos_token_ids(served.config, tokenizer, files),
                         "gguf")
    config = EngineConfig(model=str(path), weights="gguf", kv_cache_memory_bytes=POOL_BYTES,
                          kv_cache_dtype="float32")
    return LLMEngine(config, loaded)


# An F32 block's product is float32 arithmetic in another order than transformers': the default
# model's test_equivalence bound (5e-5 over logits of +-12, measured 2.5e-5) with room for the
# kernels' own summation order.
F32_LOGITS_ATOL = 2e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_matches_transformers(arch: str, tiny_model_factory, tmp_path: Path) -> None:
    hf_dir = tiny_model_factory(arch)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    engine = engine_over(write_gguf(hf_model, tmp_path / f"{arch}.gguf"), hf_dir)
    tokenizer = engine.tokenizer
    prompts = [tokenizer(text).input_ids for text in (
        "The quick brown fox jumps over the lazy dog, then runs into the forest to hide.",
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))")]
    recorder = HiddenRecorder(engine.runner.model)
    outputs = run(engine, prompts)
    with torch.no_grad():
        prefill = engine.runner.model.compute_logits(recorder.hidden[0])  # both prompts at once
        expected = [hf_model(torch.tensor([p + out[:-1]])).logits[0].float()
                    for p, out in zip(prompts, outputs, strict=True)]
    ours_first = torch.cat([prefill[:len(prompts[0])], prefill[len(prompts[0]):]])
    theirs_first = torch.cat([e[:len(p)] for e, p in zip(expected, prompts, strict=True)])
    error = (ours_first - theirs_first).abs().max().item()
    print(f"{arch}: max |gguf F32 - transformers| over prompt logits {error:.2e}")
    assert error <= F32_LOGITS_ATOL
    for prompt, out, logits in zip(prompts, outputs, expected, strict=True):
        assert out == logits[len(prompt) - 1:].argmax(-1).tolist()


# ------------------------------------------------------- the fp32 conversion (agentd's reader)


def own_conversion(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """``path`` converted by agentd's reader: its state dict and config.json text."""
    from safetensors.torch import load_file

    out = path.with_suffix(".converted")
    out.mkdir()
    assert gguf_convert.convert(path, out, "model.safetensors")
    return load_file(out / "model.safetensors"), (out / "config.json").read_text()


def transformers_config_json(model: transformers.PreTrainedModel) -> str:
    """The config.json the conversion through transformers writes for ``model``."""
    return json.dumps(default_model._config_dict(model), indent=2, default=str)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_conversion_gives_back_the_transformers_weights(arch: str, tiny_model_factory,
                                                        tmp_path: Path) -> None:
    # llama's q/k rows go back to transformers' order; qwen2's biases come along
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch),
                                                                 dtype=torch.float32)
    path = write_gguf(hf_model, tmp_path / f"{arch}.gguf")
    state, config = own_conversion(path)
    expected = hf_model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].equal(tensor), name
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                  dtype=torch.float32)
    assert config == transformers_config_json(reference)


@pytest.mark.parametrize(("type_name", "isa"), [("Q4_K_M", None), ("Q4_K_M", "torch"),
                                                ("Q8_0", None), ("Q4_0", None), ("Q4_1", None),
                                                ("Q4_1", "torch"), ("F16", None)])
def test_conversion_equals_transformers_dequantization(type_name: str, isa: str | None,
                                                       tmp_path: Path) -> None:
    # Q4_K and Q6_K (Q4_K_M's mix), Q8_0, Q4_0, Q4_1 (the default model's) and F16 blocks, on
    # the native kernels and on the torch path of a machine without a compiler; the default
    # model's own file is test_loader's (-m full: transformers reads it in ~50 s)
    path = tmp_path / f"tiny-{type_name}.gguf"
    write_synth_gguf(path, "tiny", type_name, tokenizer=False)
    ggml.set_isa(isa)
    try:
        state, config = own_conversion(path)
    finally:
        ggml.set_isa(None)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                  dtype=torch.float32)
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    assert state.keys() == expected.keys()  # tied: the head is the embedding
    for name, tensor in expected.items():
        assert state[name].equal(tensor), name
    assert config == transformers_config_json(reference)


def test_a_file_the_reader_does_not_mirror_goes_through_transformers(tiny_model_factory,
                                                                       tmp_path: Path) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen3"),
                                                                 dtype=torch.float32)
    path = write_gguf(hf_model, tmp_path / "qwen3.gguf")
    assert not gguf_convert.convert(path, tmp_path, "model.safetensors")
    assert list(tmp_path.iterdir()) == [path]  # nothing written


# ---------------------------------------------------------------- the synth tiny Q4_K_M file


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The synth tiny Q4_K_M file, and a cache dir its tokenizer files are built into once."""
    root = tmp_path_factory.mktemp("synth-tiny")
    path = root / "tiny-Q4_K_M.gguf"
    write_synth_gguf(path, "tiny", "Q4_K_M")
    return path, root / "cache"


@pytest.fixture
def tiny_llm(tiny_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> LLM:
    path, cache = tiny_gguf
    monkeypatch.setenv("AGENTD_CACHE_DIR", str(cache))
    return LLM(str(path), kv_cache_memory_bytes=POOL_BYTES)


def test_a_gguf_file_is_served_as_it_ships_by_default(tiny_llm: LLM,
                                                      tiny_gguf: tuple[Path, Path]) -> None:
    loaded, shape = tiny_llm.engine.loaded, SHAPES["tiny"]
    assert loaded.weights == "gguf" and loaded.dtype == torch.float32
    assert loaded.files.gguf == tiny_gguf[0].resolve()
    assert not list(loaded.files.path.glob("*.safetensors"))  # no conversion
    dims = loaded.model.dims
    assert (dims.hidden_size, dims.num_layers, dims.num_heads, dims.num_kv_heads,
            dims.head_dim, dims.intermediate_size) == (shape.hidden, shape.num_layers,
                                                       shape.num_heads, shape.num_kv_heads,
                                                       shape.head_dim, shape.intermediate)
    assert dims.rope_interleaved and dims.tie_word_embeddings and dims.vocab_size == 49152
    # Q4_K_M's mix as the file has it: a Q6_K attn_v beside Q4_K q and k in the last layer
    assert loaded.model.layers[1].self_attn.qkv_proj.type_names == ["Q4_K", "Q4_K", "Q6_K"]
    assert loaded.kernels["lm_head"].kernel.startswith("Q6_K")
    # its float16 pool's prefill attention multiplies in bfloat16 where the CPU can
    bf16 = (ggml.active_isa() == "avx512_vnni" and ggml._native().module.has_bf16_attention()
            and tiny_llm.engine.runner.kv_caches[0].dtype == torch.float16)
    assert loaded.kernels["attention"].kernel.endswith(
        "prefill products in " + ("bfloat16 (AVX512-BF16)" if bf16 else "fp32"))
    prompts = [tiny_llm.tokenizer(t).input_ids for t in ("Hello there", "One two three four")]
    outputs = tiny_llm.generate(prompts, GREEDY)
    assert [len(out.token_ids) for out in outputs] == [MAX_TOKENS] * 2
    assert all(0 <= t < dims.vocab_size for out in outputs for t in out.token_ids)


def test_no_float_copy_of_any_weight(tiny_llm: LLM, tiny_gguf: tuple[Path, Path]) -> None:
    model = tiny_llm.engine.loaded.model
    assert_no_float_copy(model, tiny_gguf[0])
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: the same bytes
    assert pack_linears(model) == 0  # oneDNN packing leaves block layers alone
    assert isinstance(model.lm_head, QuantLinear)


def test_loading_allocates_no_fp32_weights(tiny_gguf: tuple[Path, Path]) -> None:
    path, _ = tiny_gguf
    fp32_bytes = sum(4 * int(np.prod(t.shape)) for t in GgufFile.open(path).index.tensors)
    anon_before = proc_status_bytes("RssAnon")
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    served = load_gguf_model(path)
    grown = proc_status_bytes("RssAnon") - anon_before
    assert served.weight_bytes() * 3 < fp32_bytes  # 4-6 bits a weight vs 32
    # The tiny model's fp32 weights are 57 MB; loading takes a few MB (norms, rotary table).
    assert grown < fp32_bytes / 4
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before < fp32_bytes / 4


def test_mlock_keeps_the_mapped_weights_in_ram(tiny_gguf: tuple[Path, Path],
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path, cache = tiny_gguf
    monkeypatch.setenv("AGENTD_CACHE_DIR", str(cache))
    locked_before = proc_status_bytes("VmLck")
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    can_lock = (os.geteuid() == 0 or limit == resource.RLIM_INFINITY
                or limit >= 2 * path.stat().st_size)
    with caplog.at_level("INFO", logger="agentd"):
        llm = LLM(str(path), kv_cache_memory_bytes=POOL_BYTES, mlock=True)
    if can_lock:
        assert proc_status_bytes("VmLck") - locked_before >= path.stat().st_size
        assert "locked in RAM" in caplog.text
    else:  # an unprivileged user under a small limit: the daemon starts, and says why not
        assert "ulimit -l" in caplog.text
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == MAX_TOKENS


def test_a_failed_mlock_names_the_limit_and_what_to_do() -> None:
    problem = lock_memory(0, 1 << 20)  # nothing is mapped at address 0
    assert problem is not None and "ENOMEM" in problem and "ulimit -l" in problem
    assert "--mlock" in problem


def _one_tensor_gguf(path: Path, qtype: QT) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("attention.head_count", 4)):
        writer.add_uint32(f"llama.{key}", value)
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = np.zeros((8, 256 // block_weights * block_bytes), np.uint8)
    writer.add_tensor("token_embd.weight", rows, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.IQ4_NL])
def test_an_unsupported_block_type_is_one_line_that_says_what_to_do(qtype: QT,
                                                                    tmp_path: Path) -> None:
    path = _one_tensor_gguf(tmp_path / "odd.gguf", qtype)
    with pytest.raises(ModelLoadError) as excinfo:
        load_gguf_model(path)
    message = str(excinfo.value)
    assert "\n" not in message and "token_embd.weight" in message
    assert ("Q2_K" if qtype == QT.Q2_K else "type 20") in message
    assert message.endswith("re-quantize to Q4_K_M/Q8_0 with llama-quantize, or pass "
                            "--weights float32 to convert")


def test_weights_gguf_needs_a_gguf_and_float32_activations(tiny_model_factory) -> None:
    with pytest.raises(ModelLoadError, match="--weights gguf serves a .gguf"):
        resolve_model(str(tiny_model_factory("llama")), serve_gguf=True)
    with pytest.raises(ValueError, match="weights gguf multiplies"):
        EngineConfig(weights="gguf", dtype="bfloat16")


# ---------------------------------------------------------------- the default model


# Prompts whose greedy choices are clear: over their 8 steps the exact path's best logit leads
# the second by at least 2.2, 2.1 and 3.5, more than twice the largest logit error that rounding
# the activations to int8 makes (~1.0 on this model), so a flip would be a bug, not a near-tie.
# (Text prompts of this model often lead by < 0.5: "the capital of Italy is" flips on rounding
# alone.)
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March,",
    "<|im_start|>user\nCount from one to ten.<|im_end|>\n<|im_start|>assistant\nOne, two, three,",
]


def round_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``x`` rounded as a product's activations are: int8 per block of 32, scale max/127."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / scale, 0).round().clamp(-127, 127)
    return (q * scale).reshape(x.shape)


@pytest.mark.slow
def test_default_model_gguf_matches_the_exact_fp32_conversion(default_model_dir: Path) -> None:
    # No prompt-lookup drafts: every step then samples from its last row alone.
    args = dict(device="cpu", kv_cache_memory_bytes=POOL_BYTES, kv_cache_dtype="float32",
                speculative="off")
    served = LLM(None, weights="gguf", **args)
    assert served.engine.loaded.weights == "gguf"
    prompts = [served.tokenizer(p).input_ids for p in PROMPTS]
    assert all(len(p) > 16 for p in prompts)  # each has a whole block for the cache to hit
    recorder = HiddenRecorder(served.engine.runner.model)
    outputs = [served.generate([p], GREEDY)[0].token_ids for p in prompts]
    with torch.no_grad():  # each step's last row, as the engine samples it
        gguf_logits = torch.cat([served.engine.runner.model.compute_logits(h[-1:])
                                 for h in recorder.hidden])

    # The exact path over the same sequences, one prefill each (its rows do not depend on the
    # batch); then the reference: the same with each product's input rounded to int8 blocks of
    # 32 (absmax / 127), as the Q4_1 and Q8_0 products round theirs. Rounding is per row, so
    # one prefill rounds each row as a decode step would.
    exact = LLM(None, weights="float32", cpu_linear="torch", enable_prefix_caching=False, **args)
    assert served.engine.loaded.fingerprint != exact.engine.loaded.fingerprint
    exact_logits = _forced_logits(exact, prompts, outputs)
    hooks = [m.register_forward_pre_hook(lambda m, args: (round_activations(args[0]),))
             for m in exact.engine.runner.model.modules() if isinstance(m, nn.Linear)]
    rounded_logits = _forced_logits(exact, prompts, outputs)
    for hook in hooks:
        hook.remove()
    # Greedy tokens identical to the exact path's: its argmax along the same sequences.
    assert gguf_logits.argmax(-1).tolist() == exact_logits.argmax(-1).tolist()
    assert rounded_logits.argmax(-1).tolist() == exact_logits.argmax(-1).tolist()
    rounding_error = (rounded_logits - exact_logits).abs().max().item()
    error = (gguf_logits - exact_logits).abs().max().item()
    print(f"default model, {len(exact_logits)} positions: max |gguf - exact| {error:.4f}, "
          f"max |int8-rounded activations - exact| {rounding_error:.4f}, "
          f"max |gguf - rounded| {(gguf_logits - rounded_logits).abs().max().item():.4f}")
    # The exact path's weights are the file's blocks dequantized, so the blocks' products differ
    # from it only by the int8 rounding of their activations (one product of the kernels equals
    # the rounded reference's to ~5e-5). Through 30 layers the two roundings part ways (a value
    # one side rounds up, the other rounds down), so their logit errors are alike in size, not
    # equal: 2x the reference's is the headroom.
    assert error <= 2 * rounding_error

    batched = [out.token_ids for out in served.generate(prompts, GREEDY)]
    from_cache = served.generate(prompts, GREEDY)
    assert batched == outputs
    assert [out.token_ids for out in from_cache] == outputs
    assert all(out.num_cached_tokens > 0 for out in from_cache)
    assert_no_float_copy(served.engine.loaded.model, default_gguf_path())


def _forced_logits(llm: LLM, prompts: list[list[int]], outputs: list[list[int]]
                   ) -> torch.Tensor:
    """The logits after each prompt's last token and each output token but the last, one
    prefill per sequence (``llm`` without a prefix cache, so every row is computed)."""
    logits = []
    for prompt, out in zip(prompts, outputs, strict=True):
        recorder = HiddenRecorder(llm.engine.runner.model)
        llm.generate([prompt + out[:-1]], SamplingParams(temperature=0.0, max_tokens=1))
        with torch.no_grad():
            logits.append(llm.engine.runner.model.compute_logits(
                recorder.hidden[0][len(prompt) - 1:]))
        recorder.remove()
    return torch.cat(logits)


@pytest.mark.slow
def test_default_model_gguf_prefill_is_as_close_to_exact_as_decode(
        default_model_dir: Path) -> None:
    """A long prompt's prefill (prefill-sized products: bfloat16 GEMMs where the CPU has them,
    else the int8 kernels or fp32 tiles) against the exact fp32 conversion, at every position:
    within the bar the decode path meets (2x the error of int8-rounded activations), and the
    same top token wherever the exact top two differ by more than that error."""
    from importlib import resources

    args = dict(device="cpu", kv_cache_memory_bytes=POOL_BYTES, kv_cache_dtype="float32",
                speculative="off", enable_prefix_caching=False)
    served = LLM(None, weights="gguf", **args)
    workload = resources.files("agentd.workloads").joinpath("coding_agent.json").read_text()
    prompt = served.tokenizer(workload[:1500]).input_ids
    assert len(prompt) >= 2 * 64  # prefill-sized: past the int8 kernels' decode batches
    recorder = HiddenRecorder(served.engine.runner.model)
    served.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    recorder.remove()
    with torch.no_grad():
        gguf_logits = served.engine.runner.model.compute_logits(recorder.hidden[0])
    exact = LLM(None, weights="float32", cpu_linear="torch", **args)
    recorder = HiddenRecorder(exact.engine.runner.model)
    exact.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    recorder.remove()
    with torch.no_grad():
        exact_logits = exact.engine.runner.model.compute_logits(recorder.hidden[0])
        hooks = [m.register_forward_pre_hook(lambda m, args: (round_activations(args[0]),))
                 for m in exact.engine.runner.model.modules() if isinstance(m, nn.Linear)]
        recorder = HiddenRecorder(exact.engine.runner.model)
        exact.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        recorder.remove()
        for hook in hooks:
            hook.remove()
        rounded_logits = exact.engine.runner.model.compute_logits(recorder.hidden[0])
    error = (gguf_logits - exact_logits).abs().amax(-1)
    rounding_error = (rounded_logits - exact_logits).abs().amax(-1)
    print(f"default model, {len(prompt)}-token prefill: max |gguf - exact| "
          f"{error.max().item():.4f}, max |int8-rounded - exact| {rounding_error.max().item():.4f}")
    assert error.max() <= 2 * rounding_error.max()
    top2 = exact_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error.max()
    assert clear.sum() >= len(prompt) // 4
    assert torch.equal(gguf_logits.argmax(-1)[clear], exact_logits.argmax(-1)[clear])
