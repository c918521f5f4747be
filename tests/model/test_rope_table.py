"""The rotary table is built for the context the engine serves, not the context a model claims.

A GGUF may claim any ``context_length``, here 2^32 - 1: the KV pool caps the context served, and
the cos/sin table follows it (before, the table was built for the claim at load: 16 GiB of
float32 for 2^32 positions, then a product 32 times that). The answer is the same as the file's
with an ordinary claim.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agentd import LLM, SamplingParams
from agentd.model.synth import SHAPES, write_synth_gguf

PROMPT = [19556, 665, 28, 638, 359, 314, 253, 1345]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_a_context_claim_of_2_32_tokens_loads_with_a_table_for_the_context_served(
        tmp_path: Path) -> None:
    plain, claimed = tmp_path / "tiny.gguf", tmp_path / "tiny-claims-4g-tokens.gguf"
    write_synth_gguf(plain, "tiny", "Q8_0")
    write_synth_gguf(claimed, dataclasses.replace(SHAPES["tiny"], context_len=2**32 - 1), "Q8_0")
    expected = LLM(str(plain), kv_cache_memory="16MiB").generate(PROMPT, GREEDY)[0].token_ids
    llm = LLM(str(claimed), kv_cache_memory="16MiB")
    engine = llm.engine
    assert engine.kv_plan.model_len == 2**32 - 1 and engine.max_model_len == 16384
    assert engine.loaded.model.rotary.num_positions == engine.max_model_len
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == expected
