"""Sampler, stop conditions and the incremental detokenizer.

Sampler rules are checked on hand-made logits; seeds, stops and EOS run the real engine on a tiny
random Llama (real SmolLM2 tokenizer); the detokenizer runs on the real tokenizer.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import transformers

from agentd.engine.output_processor import OutputText
from agentd.engine.outputs import RequestOutput
from agentd.engine.request import EngineRequest, Request
from agentd.engine.sampler import Sampler
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM

VOCAB = 49152
MAX_TOKENS = 16


def make_request(request_id: str = "r", output_ids: tuple[int, ...] = (), **params) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(**params), max_output_tokens=100)
    for token_id in output_ids:
        request.append_token(token_id)
    return request


def random_logits(num_rows: int, vocab: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- the sampler on hand-made logits -------------------------------------------------------

def test_greedy_is_argmax() -> None:
    logits = random_logits(6)
    requests = [make_request(f"r{i}", temperature=0.0) for i in range(6)]
    assert Sampler(torch.device("cpu")).sample(logits, requests) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)],
                         ids=["top_k=1", "top_p=1e-6", "both"])
def test_top_k_one_or_tiny_top_p_is_greedy(params: dict) -> None:
    logits = random_logits(8, seed=1)
    sampler = Sampler(torch.device("cpu"))
    requests = [make_request(f"r{i}", temperature=1.0, seed=i, **params) for i in range(8)]
    for _ in range(5):
        assert sampler.sample(logits, requests) == logits.argmax(-1).tolist()


def draw(sampler: Sampler, logits: torch.Tensor, request: Request, num_draws: int) -> list[int]:
    return [sampler.sample(logits[None], [request])[0] for _ in range(num_draws)]


def test_same_seed_same_draws_other_seed_other_draws() -> None:
    logits = random_logits(1, seed=2)[0] / 3  # flat enough that draws vary
    first = draw(Sampler(torch.device("cpu")), logits, make_request(seed=11), 30)
    again = draw(Sampler(torch.device("cpu")), logits, make_request(seed=11), 30)
    other = draw(Sampler(torch.device("cpu")), logits, make_request(seed=12), 30)
    assert first == again
    assert first != other
    assert len(set(first)) > 5  # they are real draws, not a constant


def test_top_k_draws_only_from_the_k_best() -> None:
    logits = random_logits(1, seed=3)[0] / 3
    best = set(torch.topk(logits, 4).indices.tolist())
    draws = draw(Sampler(torch.device("cpu")), logits, make_request(seed=5, top_k=4), 200)
    assert set(draws) == best


def test_top_p_draws_only_from_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = draw(Sampler(torch.device("cpu")), logits, make_request(seed=5, top_p=0.7), 300)
    assert set(draws) == {0, 1}  # 0.5 + 0.3 is the smallest set reaching 0.7


@pytest.mark.parametrize(("penalty", "value", "expected"), [
    ("frequency_penalty", 0.3, 0),  # 5.0 - 3 * 0.3 = 4.1 > 4.0
    ("frequency_penalty", 0.4, 1),  # 5.0 - 3 * 0.4 = 3.8 < 4.0
    ("presence_penalty", 0.9, 0),  # 5.0 - 0.9 = 4.1
    ("presence_penalty", 1.1, 1),  # 5.0 - 1.1 = 3.9
    ("frequency_penalty", -1.0, 0),
])
def test_penalties_subtract_from_logits_of_generated_tokens(penalty: str, value: float,
                                                             expected: int) -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    request = make_request(output_ids=(0, 0, 0, 3), temperature=0.0, **{penalty: value})
    assert Sampler(torch.device("cpu")).sample(logits, [request]) == [expected]


def test_penalties_shift_the_sampled_distribution_as_specified() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5])
    request = make_request(output_ids=(0, 0, 1), seed=3, temperature=1.0,
                           frequency_penalty=0.5, presence_penalty=0.25)
    counts = torch.tensor([2.0, 1.0, 0.0, 0.0])
    expected = torch.softmax(logits - 0.5 * counts - 0.25 * (counts > 0), dim=-1)
    unpenalized = torch.softmax(logits, dim=-1)
    assert (expected - unpenalized).abs().max() > 0.15
    draws = draw(Sampler(torch.device("cpu")), logits, request, 4000)
    freqs = torch.bincount(torch.tensor(draws), minlength=4) / len(draws)
    torch.testing.assert_close(freqs, expected, atol=0.03, rtol=0)


def test_temperature_sharpens_the_distribution() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    for temperature, seed in ((0.5, 1), (2.0, 2)):
        draws = draw(Sampler(torch.device("cpu")), logits,
                     make_request(seed=seed, temperature=temperature), 4000)
        freqs = torch.bincount(torch.tensor(draws), minlength=3) / len(draws)
        torch.testing.assert_close(freqs, torch.softmax(logits / temperature, dim=-1),
                                   atol=0.03, rtol=0)


# --- the engine on a tiny model --------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama")), device="cpu", kv_cache_memory_bytes=16 * 2**20)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    texts = ["The quick brown fox jumps over", "def fibonacci(n):", "In 1492, Columbus",
             "Dear team, the deploy is"]
    return [llm.tokenizer(t).input_ids for t in texts]


@pytest.fixture(scope="module")
def greedy(llm: LLM, prompts: list[list[int]]) -> RequestOutput:
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True))[0]
    assert len(out.token_ids) == MAX_TOKENS and out.finish_reason == "length"
    return out


def run_mixed(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Run requests with different params in one engine batch; token ids per request."""
    engine = llm.engine
    ids = [engine.add_request(EngineRequest(p, params)) for p, params in requests]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return [tokens[rid] for rid in ids]


def sampled(seed: int | None, **params) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True,
                          **params)


def test_seeded_tokens_repeat_across_runs_and_batch_companions(
        llm: LLM, prompts: list[list[int]]) -> None:
    alone = llm.generate([prompts[0]], sampled(7))[0].token_ids
    assert llm.generate([prompts[0]], sampled(7))[0].token_ids == alone
    with_companions = run_mixed(llm, [
        (prompts[1], sampled(None)),
        (prompts[2], SamplingParams(temperature=0.0, max_tokens=5)),
        (prompts[0], sampled(7)),
        (prompts[3], sampled(8, top_p=0.9)),
    ])
    assert with_companions[2] == alone
    assert llm.engine.stats().pool.num_blocks_used == 0


def test_different_seeds_give_different_tokens(llm: LLM, prompts: list[list[int]]) -> None:
    runs = [tuple(llm.generate([prompts[0]], sampled(seed))[0].token_ids) for seed in (1, 2, 3)]
    assert len(set(runs)) == 3


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k", "top_p"])
def test_engine_top_k_one_and_tiny_top_p_equal_greedy(llm: LLM, prompts: list[list[int]],
                                                      greedy: RequestOutput,
                                                      params: dict) -> None:
    out = llm.generate([prompts[0]], sampled(4, **params))[0]
    assert out.token_ids == greedy.token_ids


def test_max_tokens_finishes_with_length(llm: LLM, prompts: list[list[int]],
                                         greedy: RequestOutput) -> None:
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=5,
                                                    ignore_eos=True))[0]
    assert out.token_ids == greedy.token_ids[:5]
    assert out.finish_reason == "length" and out.stop_reason is None


def first_occurrence_index(token_ids: list[int], start: int) -> int:
    """Index of the first token at or after ``start`` that does not occur earlier."""
    return next(i for i in range(start, len(token_ids)) if token_ids[i] not in token_ids[:i])


def test_stop_token_ids_stop_with_the_token_as_reason(llm: LLM, prompts: list[list[int]],
                                                      greedy: RequestOutput) -> None:
    index = first_occurrence_index(greedy.token_ids, 5)
    stop_id = greedy.token_ids[index]
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    stop_token_ids=[stop_id]))[0]
    assert out.token_ids == greedy.token_ids[:index + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def pick_stop_string(text: str) -> tuple[str, int]:
    """A 5-char piece from the second half of ``text`` whose first occurrence is where it is."""
    for start in range(len(text) // 2, len(text) - 5):
        stop = text[start:start + 5]
        if text.find(stop) == start:
            return stop, start
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text_and_is_the_reason(llm: LLM, prompts: list[list[int]],
                                                      greedy: RequestOutput,
                                                      include: bool) -> None:
    stop, index = pick_stop_string(greedy.text)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop, "\x00never"],
                            include_stop_str_in_output=include, ignore_eos=True)
    out = llm.generate([prompts[0]], params)[0]
    assert out.text == greedy.text[:index + len(stop) if include else index]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # Generation ended at the token that completed the stop string.
    assert out.token_ids == greedy.token_ids[:len(out.token_ids)]
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])
    assert llm.engine.stats().pool.num_blocks_used == 0


def test_streamed_text_never_shows_part_of_a_stop_string(llm: LLM, prompts: list[list[int]],
                                                          greedy: RequestOutput) -> None:
    stop, index = pick_stop_string(greedy.text)
    engine = llm.engine
    rid = engine.add_request(EngineRequest(prompts[0], SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], ignore_eos=True)))
    emitted = ""
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.request_id == rid
            emitted += delta.text
            assert greedy.text.startswith(emitted)
            assert len(emitted) <= index
    assert emitted == greedy.text[:index]


@pytest.fixture(scope="module")
def eos_model(tiny_model_factory, tmp_path_factory, greedy: RequestOutput) -> tuple[Path, int]:
    """The tiny Llama, with its 5th greedy token declared an end-of-sequence token."""
    index = first_occurrence_index(greedy.token_ids, 4)
    path = tmp_path_factory.mktemp("eos") / "tiny-llama-eos"
    shutil.copytree(tiny_model_factory("llama"), path)
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if file.exists():
            config = json.loads(file.read_text())
            config["eos_token_id"] = [2, greedy.token_ids[index]]
            file.write_text(json.dumps(config))
    return path, index


def test_eos_stops_unless_ignored(eos_model: tuple[Path, int], prompts: list[list[int]],
                                  greedy: RequestOutput) -> None:
    path, index = eos_model
    llm = LLM(str(path), device="cpu", kv_cache_memory_bytes=4 * 2**20)
    eos_id = greedy.token_ids[index]
    assert eos_id in llm.engine.loaded.eos_token_ids
    stopped = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert stopped[0].token_ids == greedy.token_ids[:index + 1]
    assert stopped[0].finish_reason == "stop" and stopped[0].stop_reason is None
    ignored = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True))
    assert ignored[0].token_ids == greedy.token_ids and ignored[0].finish_reason == "length"


# --- the incremental detokenizer -------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int], stop: Sequence[str] = (),
           include: bool = False) -> tuple[list[str], OutputText]:
    """Feed tokens one by one; the deltas a client would see, the last one on finishing."""
    detok = OutputText(tokenizer, prompt_ids, list(stop), include)
    deltas = []
    for token_id in output_ids:
        detok.add_token(token_id)
        deltas.append(detok.flush(finished=False))
        if detok.stop_reason is not None:
            break
    deltas.append(detok.flush(finished=True))
    return deltas, detok


MULTIBYTE_TEXTS = [
    "Hello 👋🏽 world! 日本語のテキスト 🎉🎉 naïve café — 中文字符 👨‍👩‍👧 end",
    "最新の日本語テキスト、中文也可以。한국어 🚀🔥 👍🏿 ﷽ ∑∫ café",
    "🧑🏻‍💻🏳️‍🌈🇯🇵 mixed emoji flags",
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_streams_without_replacement_characters(tokenizer, text: str) -> None:
    output_ids = tokenizer(text).input_ids
    # Characters span several tokens here; the test would not test much otherwise.
    assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)
    deltas, _ = stream(tokenizer, tokenizer("Say it:").input_ids, output_ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(output_ids) == text


def test_a_split_character_is_held_until_complete(tokenizer) -> None:
    output_ids = tokenizer(" 👋").input_ids
    assert len(output_ids) >= 2
    deltas, _ = stream(tokenizer, [], output_ids)
    assert deltas == [""] * (len(output_ids) - 1) + [" 👋", ""]


@pytest.mark.parametrize("seed", range(12))
def test_random_token_sequences_stream_to_the_full_decode(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    pieces = [t for text in MULTIBYTE_TEXTS for t in tokenizer(text).input_ids]
    prompt_ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
    for _ in range(20):
        # Random ids and shuffled pieces of multi-byte characters (so broken bytes too); the
        # last token is plain ASCII, so the sequence does not end inside a character.
        output_ids = [rng.choice(pieces) if rng.random() < 0.5 else rng.randrange(VOCAB)
                      for _ in range(rng.randrange(1, 40))] + tokenizer(" end").input_ids
        deltas, _ = stream(tokenizer, prompt_ids, output_ids)
        expected = tokenizer.decode(output_ids, skip_special_tokens=True)
        assert "".join(deltas) == "".join(c for c in expected if not is_dropped_control(c))


def is_dropped_control(char: str) -> bool:
    return (ord(char) < 0x20 and char not in "\t\n\r") or char == "\x7f"


def test_tokens_that_decode_to_control_characters_are_never_emitted(tokenizer) -> None:
    """A streamed reply once carried a NUL ("...fellowship home\\x00\\n"): byte-level BPE has a
    token per byte, and the model sampled NUL's (id 190). Every such token is dropped from the
    text; tab, newline and carriage return stay."""
    controls = [i for i in range(len(tokenizer))
                if any(is_dropped_control(c) for c in tokenizer.decode([i]))]
    assert 190 in controls and tokenizer.decode([190]) == "\x00"
    assert all(len(tokenizer.convert_ids_to_tokens(i)) == 1 for i in controls)  # single bytes
    head, tail = tokenizer(" fellowship home").input_ids, tokenizer("\n\tdone\r\n").input_ids
    deltas, detok = stream(tokenizer, [], head + [190] + tail)
    assert "".join(deltas) == detok.text == " fellowship home\n\tdone\r\n"
    deltas, _ = stream(tokenizer, tokenizer("Say it:").input_ids, head + controls + tail)
    assert "".join(deltas) == " fellowship home\n\tdone\r\n"


def test_valid_text_in_random_token_splits_never_shows_replacement_characters(tokenizer) -> None:
    rng = random.Random(0)
    text = "".join(MULTIBYTE_TEXTS)
    for _ in range(20):
        start = rng.randrange(len(text) - 10)
        piece = text[start:start + rng.randrange(5, 40)]
        output_ids = tokenizer(piece).input_ids
        deltas, _ = stream(tokenizer, [rng.randrange(VOCAB)], output_ids)
        assert not any("\ufffd" in delta for delta in deltas)
        assert "".join(deltas) == piece


def test_stop_string_prefix_is_held_back_until_resolved(tokenizer) -> None:
    output_ids = tokenizer("Hello world, we want world peace now").input_ids
    pieces = [tokenizer.decode([t]) for t in output_ids]
    assert pieces == ["Hello", " world", ",", " we", " want", " world", " peace", " now"]
    deltas, detok = stream(tokenizer, [], output_ids, stop=["world peace"])
    # "world" could start the stop string: held; "," resolves it; " peace" completes it.
    assert deltas == ["Hello", " ", "world,", " we", " want", " ", "", ""]
    assert detok.stop_reason == "world peace" and detok.text == "Hello world, we want "

    deltas, detok = stream(tokenizer, [], output_ids, stop=["world peace"], include=True)
    assert "".join(deltas) == "Hello world, we want world peace"
    assert deltas[-2:] == ["world peace", ""]


def test_held_back_text_is_released_when_the_request_finishes(tokenizer) -> None:
    output_ids = tokenizer("Hello wor").input_ids
    deltas, detok = stream(tokenizer, [], output_ids, stop=["world"])
    assert "".join(deltas[:-1]) == "Hello "  # "wor" might start "world"
    assert deltas[-1] == "wor" and detok.stop_reason is None


def test_stop_string_across_tokens_and_the_earliest_of_several(tokenizer) -> None:
    output_ids = tokenizer("Answer: 42</ans> done").input_ids
    deltas, detok = stream(tokenizer, [], output_ids, stop=["done", "</ans>"])
    assert detok.stop_reason == "</ans>" and "".join(deltas) == "Answer: 42"
    # " done" arrives in one token: of the two stops it completes, the earlier in the text wins.
    for stops in (["don", " done"], [" done", "don"]):
        deltas, detok = stream(tokenizer, [], output_ids, stop=stops)
        assert detok.stop_reason == " done" and "".join(deltas) == "Answer: 42</ans>"
