"""Speculative decoding through the real engine on tiny random models, against transformers.

Random tiny models do not copy their context, so prompt lookup would rarely draft for them; the
verification path must be exact for ANY draft, so most tests plant drafts: the oracle's true
continuation, right for a whole draft on some steps, wrong from its second or its first token on
others (``PlantedDrafts``). Then the greedy output must be transformers' greedy output, whether
requests run alone, batched, from the prefix cache, chunked beside prefill rows or preempted;
every step must leave each running request holding exactly the blocks of its computed tokens
(rejected drafts' blocks freed) and the pool sound. The n-gram proposer itself drafts for a model
that copies, in tests/model/test_default_model.py. The sampled path is checked for seeded
reproducibility and, on a 16-token vocabulary, for its distribution (chi-square against the exact
distribution computed by transformers).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import transformers

from agentd.config import SpeculativeConfig
from agentd.engine.model_runner import ModelRunner
from agentd.engine.request import EngineRequest, Request
from agentd.engine.sampling_params import SamplingParams
from agentd.engine.spec_decode import Speculator
from agentd.llm import LLM

BLOCK_SIZE = 16
NUM_DRAFT = 3
MAX_TOKENS = 20
POOL_BYTES = 16 * 2**20
OFF = SpeculativeConfig(method="off")


class PlantedDrafts(Speculator):
    """Drafts ``NUM_DRAFT`` tokens of each request's known continuation at every decode step,
    cycling through: all right; wrong from the second token; wrong from the first."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        super().__init__()
        self.continuations = continuations
        self.vocab_size = vocab_size
        self.num_proposals = 0

    def propose(self, running: Sequence[Request], num_waiting: int) -> None:
        for request in running:
            truth = self.continuations.get(tuple(request.prompt_token_ids))
            room = request.max_output_tokens - request.num_output_tokens - 1
            if truth is None or request.num_tokens - request.num_computed_tokens != 1 or room < 1:
                continue
            start = request.num_output_tokens
            draft = truth[start:start + min(NUM_DRAFT, room)]
            wrong_from = (None, 1, 0)[self.num_proposals % 3]
            if wrong_from is not None:
                draft[wrong_from:] = [(t + 1) % self.vocab_size for t in draft[wrong_from:]]
            request.spec_token_ids = draft
            self.num_proposals += 1


@torch.no_grad()
def oracle_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def make_prompts(tokenizer) -> list[list[int]]:
    text = ("def parse_size(text):\n    match = re.fullmatch(SIZE, text)\n    if not match:\n"
            "        raise ValueError(text)\n    return int(match.group(1)) * UNITS[unit]\n") * 4
    ids = tokenizer(text).input_ids
    return [ids[i:i + n] for i, n in ((0, 5), (3, 16), (7, 33), (11, 70))]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(path))
    expected = [oracle_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    return path, prompts, expected


def planted_llm(path: Path, continuations: dict, **engine_args) -> LLM:
    engine_args.setdefault("kv_cache_memory_bytes", POOL_BYTES)
    llm = LLM(str(path), device="cpu", dtype="float32", **engine_args)
    llm.engine.speculator = PlantedDrafts(continuations, llm.engine.loaded.model.dims.vocab_size)
    return llm


def run_checked(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                ) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Run to the end, checking after every step that each running request holds exactly the
    blocks of its computed tokens and the pool is sound. Returns the tokens per request and,
    per step, (tokens, drafts) of each scheduled row."""
    engine = llm.engine
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(EngineRequest(p, sp))
           for p, sp in zip(prompts, params_list, strict=True)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = []
    execute = engine.runner.execute

    def recording_execute(scheduled):
        steps.append([(len(s.token_ids), s.num_draft_tokens) for s in scheduled])
        return execute(scheduled)

    engine.runner.execute = recording_execute
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.token_ids)
            for request in engine.scheduler.running:
                held = len(engine.kv_cache.block_table(request.request_id))
                assert held == -(-request.num_computed_tokens // BLOCK_SIZE)
            engine.kv_cache.pool.check_integrity()
    finally:
        engine.runner.execute = execute
    assert engine.stats().pool.num_blocks_used == 0
    return [tokens[rid] for rid in ids], steps


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_greedy_with_drafts_equals_transformers_alone_batched_and_from_cache(case) -> None:
    path, prompts, expected = case
    llm = planted_llm(path, {tuple(p): e for p, e in zip(prompts, expected, strict=True)})
    for prompt, want in zip(prompts, expected, strict=True):
        assert run_checked(llm, [prompt], GREEDY)[0] == [want]
    batched, steps = run_checked(llm, prompts, GREEDY)  # the second run hits the prefix cache
    assert batched == expected
    assert any(sum(1 for _, d in rows if d) > 1 for rows in steps)  # drafts of several rows
    stats = llm.engine.stats()
    assert stats.scheduler.prefix_cache_hits > 0
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens
    # every third draft was right: those steps emitted NUM_DRAFT + 1 tokens
    assert stats.totals.num_steps < 2 * len(prompts) * MAX_TOKENS


def test_greedy_with_drafts_over_an_fp16_pool_equals_greedy_without(case) -> None:
    # a GGUF's pool: a step's draft rows attend as decode rows on the C++ kernel
    # (kernels/backend.py cpu_prefill), the tokens as one row a step gives them
    path, prompts, _ = case
    plain = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="float16",
                kv_cache_memory_bytes=POOL_BYTES, speculative=OFF)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    llm = planted_llm(path, {tuple(p): e for p, e in zip(prompts, expected, strict=True)},
                      kv_cache_dtype="float16")
    batched, steps = run_checked(llm, prompts, GREEDY)
    assert batched == expected
    assert any(d for rows in steps for _, d in rows)
    assert 0 < llm.engine.stats().spec.num_accepted_tokens


def test_greedy_with_drafts_beside_prefill_chunks_and_under_preemption(case) -> None:
    path, prompts, expected = case
    continuations = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    llm = planted_llm(path, continuations, max_num_batched_tokens=24)
    outputs, steps = run_checked(llm, prompts, GREEDY)
    assert outputs == expected
    assert any(any(d for _, d in rows) and any(n > 1 and not d for n, d in rows)
               for rows in steps), "no step held a draft beside a prefill chunk"

    model = llm.engine.runner.model
    num_blocks = 8  # 128 tokens: the longest request (90) fits alone, all four never do
    pool_bytes = num_blocks * ModelRunner.kv_bytes_per_block(model, BLOCK_SIZE, torch.float32)
    small = planted_llm(path, continuations, kv_cache_memory_bytes=pool_bytes)
    outputs, _ = run_checked(small, prompts, GREEDY)
    assert small.engine.stats().scheduler.num_preemptions > 0
    assert outputs == expected


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = make_prompts(transformers.AutoTokenizer.from_pretrained(path))
    off = LLM(str(path), device="cpu", kv_cache_memory_bytes=POOL_BYTES, speculative=OFF)
    return path, prompts, off


def pick_stop_string(text: str, start: int) -> str:
    """A 4-char piece of ``text`` from ``start`` on whose first occurrence is there."""
    return next(text[i:i + 4] for i in range(start, len(text) - 4)
                if text.find(text[i:i + 4]) == i)


def test_stops_and_streaming_are_as_without_speculation(llama, monkeypatch) -> None:
    """A step may accept several tokens; stop strings, stop tokens, max_tokens and the streamed
    text must come out exactly as when each token has its own step."""
    path, prompts, off = llama
    reference = off.generate(prompts, GREEDY)
    llm = planted_llm(path, {tuple(p): o.token_ids for p, o in zip(prompts, reference,
                                                                  strict=True)})
    truncations = []
    truncate = Request.truncate
    monkeypatch.setattr(Request, "truncate",
                        lambda self, n: truncations.append(n) or truncate(self, n))
    cases = []
    for ref in reference:
        for start in (3, len(ref.text) // 2):
            cases.append(dict(stop=[pick_stop_string(ref.text, start)]))
            cases.append(dict(stop=[pick_stop_string(ref.text, start)],
                              include_stop_str_in_output=True))
        cases.append(dict(stop_token_ids=[ref.token_ids[7]]))
    cases += [dict(max_tokens=n) for n in (1, 2, 5, 6, 9)]
    for extra in cases:
        params = SamplingParams(**{**dict(temperature=0.0, max_tokens=MAX_TOKENS,
                                          ignore_eos=True), **extra})
        want = off.generate(prompts, params)
        engine = llm.engine
        ids = [engine.add_request(EngineRequest(p, params)) for p in prompts]
        streamed = {rid: "" for rid in ids}
        got = {}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                streamed[delta.request_id] += delta.text
                for stop in params.stop:
                    assert stop not in streamed[delta.request_id] or (
                        params.include_stop_str_in_output and delta.finished)
                if delta.finished:
                    got[delta.request_id] = delta
        for rid, ref in zip(ids, want, strict=True):
            delta = got[rid]
            assert streamed[rid] == ref.text, extra
            assert (delta.num_output_tokens, delta.finish_reason, delta.stop_reason) == (
                len(ref.token_ids), ref.finish_reason, ref.stop_reason), extra
    assert truncations, "no stop string fell inside a step's accepted tokens"
    assert llm.engine.stats().spec.num_accepted_tokens > 0
    assert llm.engine.stats().pool.num_blocks_used == 0


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9),
                                    dict(temperature=1.2, top_k=30)])
def test_a_seeded_request_gets_the_same_tokens_with_drafts(llama, params: dict) -> None:
    path, prompts, off = llama
    sampled = [SamplingParams(seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
               for i in range(len(prompts))]
    want, _ = run_checked(off, prompts, sampled)
    llm = planted_llm(path, {tuple(p): w for p, w in zip(prompts, want, strict=True)})
    got, _ = run_checked(llm, prompts, sampled)
    assert got == want
    stats = llm.engine.stats()
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens


# --- the distribution of sampled tokens --------------------------------------------------------

VOCAB = 16
NUM_DRAWS = 3000


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, default_model_dir) -> Path:
    """A tiny Llama over 16 tokens: every token has a sizeable probability, so drafts are
    accepted often enough, and rejected often enough, for the counts to show a wrong rule."""
    path = tmp_path_factory.mktemp("vocab16") / "tiny-llama-16"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


@torch.no_grad()
def exact_distributions(path: Path, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """From transformers at temperature 1: P(t1) ``[V]``, P(t2 | t1) ``[V, V]`` and
    P(t3 | t1, t2) ``[V, V, V]`` for the first three output tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        return torch.softmax(model(prefixes, use_cache=False).logits[:, -1].double(), dim=-1)

    base = torch.tensor([prompt])
    ones = torch.cat([base.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
    twos = torch.cat([ones.repeat_interleave(VOCAB, 0),
                      torch.arange(VOCAB).repeat(VOCAB)[:, None]], dim=1)
    return next_probs(base)[0], next_probs(ones), next_probs(twos).view(VOCAB, VOCAB, VOCAB)


class LikelyDrafts(Speculator):
    """After the first token t1, drafts the most likely second token given t1: accepted about
    as often as that token's probability."""

    def __init__(self, p2: torch.Tensor) -> None:
        super().__init__()
        self.best_second = p2.argmax(-1).tolist()

    def propose(self, running: Sequence[Request], num_waiting: int) -> None:
        for request in running:
            if request.num_output_tokens == 1:
                request.spec_token_ids = [self.best_second[request.output_token_ids[0]]]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 draws are pooled into one."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten().double()
    small = expected < 5
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def test_sampled_drafts_keep_the_model_distribution(small_vocab_model: Path) -> None:
    """3,000 seeded requests of 3 tokens at temperature 1, each drafting its likeliest second
    token: the second and third tokens (the ones a draft decides: the third is the bonus token
    when the draft is kept) follow transformers' exact joint distribution."""
    prompt = [3 + (7 * i) % (VOCAB - 3) for i in range(40)]
    p1, p2, p3 = exact_distributions(small_vocab_model, prompt)
    llm = LLM(str(small_vocab_model), device="cpu", kv_cache_memory_bytes=POOL_BYTES,
              max_num_seqs=64)
    llm.engine.speculator = LikelyDrafts(p2)
    counts = torch.zeros(VOCAB, VOCAB)
    for first in range(0, NUM_DRAWS, 64):
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True)
                  for seed in range(first, min(first + 64, NUM_DRAWS))]
        outputs, _ = run_checked(llm, [prompt] * len(params), params)
        for tokens in outputs:
            counts[tokens[1], tokens[2]] += 1
    stats = llm.engine.stats()
    assert stats.spec.num_drafts == NUM_DRAWS
    acceptance = stats.spec.num_accepted_tokens / stats.spec.num_draft_tokens
    assert 0.2 < acceptance < 0.9
    exact = torch.einsum("a,ab,abc->bc", p1, p2, p3)
    p_value = chi_square_p_value(counts, exact)
    print(f"p = {p_value:.3f}, acceptance {acceptance:.2f}")
    assert p_value > 1e-3, f"p = {p_value:.2e}, acceptance {acceptance:.2f}"


def test_a_constrained_requests_mask_finds_its_row_after_anothers_drafts(llama) -> None:
    """When a constrained request's row comes after a drafting request's rows in one step, its
    bitmask still lands on its own row."""
    from agentd.engine.spec_decode import can_speculate
    from agentd.structured.params import StructuredOutputsParams

    path, prompts, off = llama
    choices = ["red green blue", "cyan"]
    constrained = SamplingParams(temperature=0.0, max_tokens=16,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
    assert can_speculate(Request("c", [1], constrained, 16))
    assert not can_speculate(Request("p", [1], SamplingParams(presence_penalty=0.5), 16))
    want = off.generate([prompts[0]], GREEDY)[0]
    solo = off.generate([prompts[1]], constrained)[0]
    assert solo.text in choices
    llm = planted_llm(path, {tuple(prompts[0]): want.token_ids})
    engine = llm.engine
    first = engine.add_request(EngineRequest(prompts[0], GREEDY))
    engine.step()
    engine.step()  # `first` decodes, with drafts from now on
    second = engine.add_request(EngineRequest(prompts[1], constrained))
    tokens: dict[str, list[int]] = {first: [], second: []}
    rows = []
    execute = engine.runner.execute
    engine.runner.execute = lambda s: rows.append([(x.request_id, x.num_draft_tokens)
                                                   for x in s]) or execute(s)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    assert rows[0] == [(first, NUM_DRAFT), (second, 0)]  # its prompt's row after the drafts
    assert all(d == 0 for step in rows for rid, d in step if rid == second)
    assert tokens[second] == solo.token_ids
    assert engine.stats().pool.num_blocks_used == 0


@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_drafts_keep_the_constrained_greedy_output(llama, jump_forward: bool) -> None:
    """A constrained request drafts too: each draft is cut where its grammar refuses it, and
    each draft row is masked with the grammar after the draft tokens before it; the output is
    the constrained greedy output without speculation, token for token."""
    from agentd.structured.params import StructuredOutputsParams

    path, prompts, off = llama
    schema = {"type": "object", "additionalProperties": False, "required": ["mode", "tags"],
              "properties": {"mode": {"enum": ["fast", "careful"]},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"enum": ["io", "cpu", "disk"]}}}}
    params = SamplingParams(temperature=0.0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=schema))
    plain = LLM(str(path), device="cpu", kv_cache_memory_bytes=POOL_BYTES, speculative=OFF,
                jump_forward=jump_forward)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = planted_llm(path, {tuple(p): w for p, w in zip(prompts, want, strict=True)},
                      jump_forward=jump_forward)
    got, _ = run_checked(llm, prompts, params)
    assert got == want
    stats = llm.engine.stats()
    assert stats.spec.num_drafts > 0 and stats.spec.num_accepted_tokens > 0
