"""The random-weight GGUF generator on the tiny shape: files gguf's own reader opens, tensors of
llama.cpp's names, shapes and Q4_K_M mix, real blocks whose dequantized values look like a fresh
init, and the default model's tokenizer keys, copied exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from agentd.model.default_model import default_gguf_path
from agentd.model.synth import (
    SHAPES,
    TensorPlan,
    plan_tensors,
    read_tokenizer_fields,
    tensor_bytes,
    write_synth_gguf,
)

QT = gguf.GGMLQuantizationType
TINY = SHAPES["tiny"]


def _dequantized(data: np.ndarray, qtype: QT, num_rows: int = 32) -> np.ndarray:
    return gguf.quants.dequantize(data[:num_rows], qtype)


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> gguf.GGUFReader:
    # Without the tokenizer: GGUFReader takes seconds over a 49k-entry vocab.
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_synth_gguf(path, "tiny", "Q4_K_M", tokenizer=False)
    return gguf.GGUFReader(path)


def test_q4_k_m_tensors_have_llama_cpp_names_shapes_and_types(reader: gguf.GGUFReader) -> None:
    tensors = {t.name: t for t in reader.tensors}
    expected = {
        "token_embd.weight": ([256, 49152], QT.Q6_K),  # tied: quantized as the head
        "blk.0.attn_q.weight": ([256, 256], QT.Q4_K),
        "blk.0.attn_k.weight": ([256, 128], QT.Q4_K),
        "blk.0.attn_v.weight": ([256, 128], QT.Q4_K),
        "blk.1.attn_v.weight": ([256, 128], QT.Q6_K),  # the last eighth gets more bits
        "blk.0.attn_output.weight": ([256, 256], QT.Q4_K),
        "blk.0.ffn_gate.weight": ([256, 512], QT.Q4_K),
        "blk.0.ffn_up.weight": ([256, 512], QT.Q4_K),
        "blk.0.ffn_down.weight": ([512, 256], QT.Q4_K),
        "blk.1.ffn_down.weight": ([512, 256], QT.Q6_K),
        "blk.0.attn_norm.weight": ([256], QT.F32),
        "blk.1.ffn_norm.weight": ([256], QT.F32),
        "output_norm.weight": ([256], QT.F32),
    }
    assert len(tensors) == 1 + 9 * 2 + 1  # no output.weight: the embedding is tied
    for name, (shape, qtype) in expected.items():
        assert [int(d) for d in tensors[name].shape] == shape, name
        assert tensors[name].tensor_type == qtype, name


def test_metadata_states_the_shape(reader: gguf.GGUFReader) -> None:
    def value(key: str) -> object:
        return reader.fields[key].contents()

    assert value("general.architecture") == "llama"
    assert value("general.name") == "synth-tiny"
    assert value("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert value("general.quantization_version") == 2
    assert value("llama.block_count") == 2
    assert value("llama.embedding_length") == 256
    assert value("llama.feed_forward_length") == 512
    assert value("llama.attention.head_count") == 4
    assert value("llama.attention.head_count_kv") == 2
    assert value("llama.rope.dimension_count") == 64
    assert value("llama.vocab_size") == 49152


def test_dequantized_weights_look_like_a_fresh_init(reader: gguf.GGUFReader) -> None:
    for tensor in reader.tensors:
        values = _dequantized(tensor.data, tensor.tensor_type)
        assert np.isfinite(values).all(), tensor.name
        if tensor.tensor_type == QT.F32:
            assert (values == 1).all(), tensor.name  # RMSNorm gains
        else:
            assert 0.015 < values.std() < 0.025, tensor.name
            assert abs(values.mean()) < 0.002, tensor.name


def test_q4_k_sub_blocks_are_centred() -> None:
    # A Q4_K scale packing that put mins where scales belong would offset each 32-weight
    # sub-block by up to its own spread; centred, a sub-block's mean is ~0.18 of its std.
    plan = TensorPlan("blk.0.attn_q.weight", (64, 256), QT.Q4_K)
    sub_blocks = _dequantized(tensor_bytes(plan, seed=0), QT.Q4_K, 64).reshape(-1, 32)
    ratio = np.abs(sub_blocks.mean(axis=1)) / sub_blocks.std(axis=1)
    assert np.median(ratio) < 0.3


@pytest.mark.parametrize("type_name, linear, head", [("Q8_0", QT.Q8_0, QT.Q8_0),
                                                     ("Q4_0", QT.Q4_0, QT.Q6_K),
                                                     ("F16", QT.F16, QT.F16)])
def test_other_mixes_and_an_untied_head(type_name: str, linear: QT, head: QT) -> None:
    untied = dataclasses.replace(TINY, tied=False)
    plans = {p.name: p for p in plan_tensors(untied, type_name, vocab_size=512)}
    assert plans["token_embd.weight"].qtype == linear
    assert plans["output.weight"].qtype == head
    assert {plans[f"blk.{i}.{k}.weight"].qtype for i in range(2)
            for k in ("attn_v", "ffn_down", "attn_q")} == {linear}
    for plan in (plans["blk.1.ffn_down.weight"], plans["output.weight"]):
        values = _dequantized(tensor_bytes(plan, seed=1), plan.qtype)
        assert np.isfinite(values).all() and 0.015 < values.std() < 0.025, plan.name


def test_seeds_change_bytes_and_a_seed_repeats_them() -> None:
    plan = TensorPlan("blk.0.ffn_up.weight", (512, 256), QT.Q4_K)
    first = tensor_bytes(plan, seed=0)
    assert np.array_equal(first, tensor_bytes(plan, seed=0))
    assert not np.array_equal(first, tensor_bytes(plan, seed=1))


def test_tokenizer_keys_equal_the_default_models(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_synth_gguf(path, "tiny", "Q8_0", seed=3)
    ours, default = read_tokenizer_fields(path), read_tokenizer_fields(default_gguf_path())
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.chat_template"} <= default.keys()
    assert ours == default
    assert len(ours["tokenizer.ggml.tokens"].value) == 49152


@pytest.mark.parametrize("shape_name, more_bits", [
    ("1.7b", {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}),
    ("8b", {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}),
])
def test_q4_k_m_gives_q6_k_to_the_layers_llama_quantize_does(shape_name: str,
                                                             more_bits: set[int]) -> None:
    # The sets are what llama-quantize (llama.cpp 0c1e570) wrote for F16 files of these layer
    # counts: attn_v and ffn_down of the first and last eighth and of every third layer between.
    plans = plan_tensors(SHAPES[shape_name], "Q4_K_M", vocab_size=49152)
    for kind in ("attn_v", "ffn_down"):
        q6 = {int(p.name.split(".")[1]) for p in plans
              if p.name.endswith(f"{kind}.weight") and p.qtype == QT.Q6_K}
        assert q6 == more_bits, kind
    heads = [p for p in plans if p.name in ("token_embd.weight", "output.weight")]
    assert [p.qtype for p in heads] == ([QT.Q6_K] if SHAPES[shape_name].tied
                                        else [QT.Q4_K, QT.Q6_K])
