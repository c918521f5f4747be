"""The engine end to end on the Triton backend (under the interpreter on CPU): the same greedy
tokens as the torch backend, with prefix-cache hits and a mixed decode + prefill step."""

from __future__ import annotations

import torch

from agentd import LLM, SamplingParams


def run(path, backend: str) -> tuple[list[list[int]], list[int]]:
    llm = LLM(str(path), attention_backend=backend, kv_cache_memory_bytes=2 * 2**20,
              max_num_batched_tokens=48)
    prompts = ["The cat sat on the mat and looked around the room.",
               "Paged attention reads keys and values through a block table " * 3,
               "Short"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts[1:2], params)  # hits the cache: prefill over a cached prefix
    assert again[0].num_cached_tokens > 0
    return [o.token_ids for o in first], again[0].token_ids


def test_triton_backend_matches_torch_backend(tiny_model_factory):
    path = tiny_model_factory("qwen3")  # GQA 4:1 and head_dim 32
    torch.set_num_threads(1)
    assert run(path, "triton") == run(path, "torch")
