"""The default model (SmolLM2-135M-Instruct) end to end: greedy equals transformers, and a
cached agent prefix (1,008 tokens in CI, 2,000 in ``-m full``) is served from the pool so that
only the new tokens run."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import pytest
import torch
import transformers

from agentd.config import SpeculativeConfig
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.engine.spec_decode import Speculator
from agentd.llm import LLM

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Give me three tips for writing clear commit messages."}],
]
NUM_CHAT_TOKENS = 24
TAIL_LEN = 30
NUM_LONG_TOKENS = 4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="160MiB", device="cpu", dtype="float32", weights="float32")


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir,
                                                             dtype=torch.float32).eval()


def test_greedy_chat_completions_equal_transformers_generate(llm: LLM, hf_model) -> None:
    tokenizer = llm.tokenizer
    prompts = [tokenizer(tokenizer.apply_chat_template(chat, tokenize=False,
                                                        add_generation_prompt=True),
                         add_special_tokens=False).input_ids for chat in CHATS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_CHAT_TOKENS))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=NUM_CHAT_TOKENS)
        expected = generated[0, len(prompt):].tolist()
        assert out.token_ids == expected, tokenizer.decode(expected)
        assert out.text.strip()  # an instruct model answers in words
    assert llm.engine.stats().pool.num_blocks_used == 0


def long_prompts(tokenizer, prefix_len: int) -> tuple[list[int], list[int]]:
    """Two prompts that share their first ``prefix_len`` tokens (agent system prompt) and then
    differ."""
    workload = json.loads(
        resources.files("agentd.workloads").joinpath("coding_agent.json").read_text()
    )
    ids = tokenizer(workload["system"] + "\n\n" + "\n".join(workload["turns"])).input_ids
    assert len(ids) >= prefix_len + TAIL_LEN
    first = ids[:prefix_len + TAIL_LEN]
    turn = tokenizer("\n\n" + workload["turns"][-1]).input_ids[:TAIL_LEN]
    assert len(turn) == TAIL_LEN and turn[0] != first[prefix_len]
    return first, ids[:prefix_len] + turn


# whole blocks of 16: 63 in CI (three fp32 prefills of 2,000 tokens were ~45 s of its time), 125
@pytest.mark.parametrize("prefix_len", [1008, pytest.param(2000, marks=pytest.mark.full)])
def test_a_cached_prefix_runs_only_the_remaining_tokens(llm: LLM, prefix_len: int) -> None:
    engine = llm.engine
    first, second = long_prompts(llm.tokenizer, prefix_len)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_LONG_TOKENS, ignore_eos=True)
    cold = llm.generate([first], params)[0]
    assert cold.num_cached_tokens == 0

    starts: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def recording_execute(scheduled):
        starts.extend((s.start_position, len(s.token_ids)) for s in scheduled)
        return execute(scheduled)

    engine.runner.execute = recording_execute
    # one token per decode step: speculation off (its steps: test_prompt_lookup_drafts_...)
    speculator, engine.speculator = engine.speculator, Speculator()
    before = engine.stats().totals.num_model_tokens
    try:
        warm = llm.generate([second], params)[0]
    finally:
        engine.runner.execute = execute
        engine.speculator = speculator
    processed = engine.stats().totals.num_model_tokens - before

    assert warm.num_cached_tokens == prefix_len
    # The prompt's uncached tail, then one token per decode step (the last sample never runs).
    assert processed == len(second) - warm.num_cached_tokens + NUM_LONG_TOKENS - 1
    assert starts[0] == (prefix_len, TAIL_LEN)
    assert starts[1:] == [(len(second) + i, 1) for i in range(NUM_LONG_TOKENS - 1)]

    # The same prompt on an engine without a prefix cache (same weights) gives the same tokens.
    config = dataclasses.replace(engine.config, enable_prefix_caching=False,
                                 speculative=SpeculativeConfig(method="off"))
    uncached = LLMEngine(config, loaded=engine.loaded)
    uncached.add_request(EngineRequest(second, params))
    token_ids: list[int] = []
    while uncached.has_unfinished_requests():
        for delta in uncached.step():
            token_ids.extend(delta.token_ids)
    assert uncached.stats().totals.num_model_tokens == len(second) + NUM_LONG_TOKENS - 1
    assert token_ids == warm.token_ids


def code_edit_prompts(tokenizer) -> list[list[int]]:
    """Requests of the code-editing workload: the reply rewrites a function quoted in the prompt
    (all share the ~950-token system prompt and tools)."""
    from agentd.chat import render_chat

    workload = json.loads(
        resources.files("agentd.workloads").joinpath("code_edit_agent.json").read_text()
    )
    return [render_chat(tokenizer, [{"role": "system", "content": workload["system"]},
                                    {"role": "user", "content": workload["turns"][i]}],
                        workload["tools"], None).prompt_token_ids for i in CODE_EDIT_TURNS]


CODE_EDIT_TURNS = (0, 9)
NUM_CODE_EDIT_TOKENS = 40


@pytest.mark.full
def test_prompt_lookup_drafts_leave_greedy_output_unchanged(llm: LLM, hf_model) -> None:
    """The n-gram proposer drafts from the quoted function and most drafts are accepted; the
    tokens are transformers' greedy tokens, alone and batched (the second request hits the
    first's cached prefix), and the same engine's without speculation.

    In ``-m full`` (about 60 s of one CI thread, fp32 decode): CI holds drafts to leave greedy
    tokens unchanged on tiny models of every architecture (tests/engine/test_spec_engine.py)
    and the default model to accept them and stream what it returns whole (tests/server/
    test_e2e.py)."""
    engine = llm.engine
    prompts = code_edit_prompts(llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_CODE_EDIT_TOKENS)
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=NUM_CODE_EDIT_TOKENS)
        expected.append(generated[0, len(prompt):].tolist())
    before = engine.stats()
    alone = [llm.generate([prompt], params)[0] for prompt in prompts]
    after = engine.stats()
    assert [out.token_ids for out in alone] == expected
    assert alone[1].num_cached_tokens > 800  # the system prompt and tools
    accepted = after.spec.num_accepted_tokens - before.spec.num_accepted_tokens
    num_tokens = sum(len(out.token_ids) for out in alone)
    assert accepted >= num_tokens // 4
    # one step a token the drafts did not supply, and the prompt's chunks before its last
    prefill_steps = sum(len(engine.scheduler.prefill_chunks(out.num_cached_tokens, len(p))) - 1
                        for p, out in zip(prompts, alone, strict=True))
    assert (after.totals.num_steps - before.totals.num_steps
            <= num_tokens - accepted + prefill_steps)
    assert [out.token_ids for out in llm.generate(prompts, params)] == expected

    speculator, engine.speculator = engine.speculator, Speculator()  # --speculative off
    try:
        assert [out.token_ids for out in llm.generate(prompts, params)] == expected
    finally:
        engine.speculator = speculator
    assert engine.stats().pool.num_blocks_used == 0
