"""The accuracy bar of the weight formats, on the default model (SmolLM2-135M-Instruct, Q4_1).

A format passes when (1) its logits over every position of an agent prompt stay within twice
transformers' own bfloat16 error on the same prompt (the bound of the ``--dtype bfloat16`` check),
and (2) its greedy 32-token continuations equal the exact mode's (``--weights float32 --dtype
float32``, which equals transformers token for token) on >= 60% of 24 agent prompts, batched and
one at a time, with every decode row through the format's own kernel (the calibrated crossover
may send a 24-row step to the dense fp32 twin, which would measure the exact mode instead; the
logits check runs even the prefill through the kernel). ``--weights auto`` chooses only among
``ACCURATE_FORMATS``: the test fails if a listed format misses the bar or an unlisted one meets
it, so the list is what was measured.

The whole sweep (24 prompts x 32 tokens per format, batched and one at a time) is a measurement of
minutes on 2 cores: it runs with ``pytest -m full`` (docs/weights.md, "Weight formats"), after any
change to attention, norms or a format's kernel. CI keeps its first check for the listed formats,
one prefill each: their logits within the bound (the check a broken kernel or an LM head quantized
to 4 bits misses by far); each format serving a tiny model is tests/model/test_quant.py.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
import torch
import transformers

from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM
from agentd.model.dispatch import ACCURATE_FORMATS, WEIGHT_FORMATS
from agentd.model.quant import LowPrecisionLinear

pytestmark = pytest.mark.slow

SYSTEM_CHARS = (300, 2500, 7000)  # the coding agent's system prompt, cut three ways
NUM_TURNS = 8  # x 3 systems = 24 prompts, 110-1,600 tokens
NUM_TOKENS = 32
MIN_SAME = 0.6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _all_cores() -> Iterator[None]:
    """The default model on 1,600-token prompts gains from every core (tests/model runs tiny
    models single-threaded otherwise)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    yield
    torch.set_num_threads(num_threads)


def agent_prompts(tokenizer) -> list[list[int]]:
    workload = json.loads(
        resources.files("agentd.workloads").joinpath("coding_agent.json").read_text())
    prompts = []
    for chars in SYSTEM_CHARS:
        for turn in workload["turns"][:NUM_TURNS]:
            chat = [{"role": "system", "content": workload["system"][:chars]},
                    {"role": "user", "content": turn}]
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def make_llm(weights: str) -> LLM:
    return LLM(device="cpu", dtype="float32", weights=weights, kv_cache_memory="192MiB")


def kernel_up_to(llm: LLM, rows: int | None) -> None:
    """Every low-precision layer multiplies calls of up to ``rows`` rows (None: all) with its
    format's kernel."""
    for layer in llm.engine.runner.model.modules():
        if isinstance(layer, LowPrecisionLinear):
            limit = layer.max_kernel_rows
            layer.max_kernel_rows = None if rows is None or limit is None else max(limit, rows)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from agentd.model.loader import load_tokenizer, resolve_model

    return agent_prompts(load_tokenizer(resolve_model(None)))


@pytest.fixture(scope="module")
def exact(prompts) -> tuple[LLM, list[list[int]], list[list[int]]]:
    llm = make_llm("float32")
    return llm, prompts, [out.token_ids for out in llm.generate(prompts, GREEDY)]


@torch.no_grad()
def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Our logits at every position of ``prompt`` (one cold prefill)."""
    hidden: list[torch.Tensor] = []
    model = llm.engine.runner.model
    handle = model.register_forward_hook(lambda m, a, out: hidden.append(out.detach().clone()))
    try:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        handle.remove()
    return model.compute_logits(hidden[0]).float()


@pytest.fixture(scope="module")
def logit_bound(prompts, default_model_dir: Path) -> tuple[list[int], torch.Tensor, float]:
    """An uncached prompt, transformers' fp32 logits on it, and twice its bf16 error."""
    prompt = prompts[NUM_TURNS - 1][:-1]  # a prefix no run has cached whole
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0].float()
        hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)(torch.tensor([prompt])).logits[0]
    return prompt, expected, 2 * (hf_bf16.float() - expected).abs().max().item()


def share_same(outputs: list[list[int]], expected: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(outputs, expected, strict=True)) / len(expected)


def _share(value: float | None) -> str:
    return "not run (an earlier check missed)" if value is None else f"{value:.0%}"


def max_logit_error(weights: str, logit_bound) -> float:
    """|logits - fp32 oracle| at most, every row (the prefill's too) through the kernel."""
    prompt, oracle, _ = logit_bound
    llm = make_llm(weights)
    kernel_up_to(llm, None)
    return (prompt_logits(llm, prompt) - oracle).abs().max().item()


@pytest.mark.parametrize("weights", ACCURATE_FORMATS)
def test_accurate_formats_keep_logits_within_the_bound(weights: str, logit_bound) -> None:
    error, bound = max_logit_error(weights, logit_bound), logit_bound[2]
    print(f"\n{weights}: max |logit - fp32 oracle| {error:.3f} (bound {bound:.3f})")
    assert error <= bound, f"{weights} is in ACCURATE_FORMATS but its logits miss the bound"


@pytest.mark.full
@pytest.mark.parametrize("weights", [w for w in WEIGHT_FORMATS if w != "float32"])
def test_weight_format_against_the_accuracy_bar(weights: str, exact, logit_bound) -> None:
    _, prompts, expected = exact
    prompt, oracle, bound = logit_bound
    llm = make_llm(weights)
    calibrated = llm.engine.loaded.compute_report()["kernels"]
    kernel_up_to(llm, None)
    error = (prompt_logits(llm, prompt) - oracle).abs().max().item()
    # The checks run in order and stop at the first one missed (the verdict is the same; the
    # suite saves the continuations of a format already out: int8's logits, bf16's batch).
    batched = alone = None
    if error <= bound:
        llm = make_llm(weights)  # a fresh cache: nothing computed by the kernel-only prefill
        kernel_up_to(llm, len(prompts))
        batched = share_same([o.token_ids for o in llm.generate(prompts, GREEDY)], expected)
        if batched >= MIN_SAME:
            alone = share_same([llm.generate([p], GREEDY)[0].token_ids for p in prompts],
                               expected)
    print(f"\n{weights}: max |logit - fp32 oracle| {error:.3f} (bound {bound:.3f}); greedy "
          f"32 tokens same as exact: batched {_share(batched)}, one at a time {_share(alone)}; "
          f"calibrated kernels {calibrated}")
    passes = error <= bound and batched is not None and batched >= MIN_SAME and \
        alone is not None and alone >= MIN_SAME
    assert passes == (weights in ACCURATE_FORMATS), (
        f"{weights} {'meets' if passes else 'misses'} the bar: update ACCURATE_FORMATS only "
        "with the measured figures in docs/weights.md")
