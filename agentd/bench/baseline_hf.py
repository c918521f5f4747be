"""The naive reference: the same prompts through transformers' ``model.generate``, one at a time.

This is the baseline of the PagedAttention paper's comparisons: no batching across requests and
no cache shared between them, so every request prefills its whole prompt. Prompts are rendered
with the same chat template (``agentd.chat.render_chat``) from the same trimmed workload, greedy,
with exactly ``max_tokens`` new tokens (``min_new_tokens``, as ``ignore_eos`` does for the
server). TTFT is the time from calling ``generate`` to the streamer receiving the first new
token; throughput is output tokens over the wall time of all requests, prefill included.

Invariant: imported only when ``--baseline hf`` runs (it imports torch and transformers); the
model is fp32 on the CPU, as agentd runs it on a CPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

from agentd.bench.client import RequestResult
from agentd.bench.results import BaselineResult
from agentd.bench.rss import read_status_bytes
from agentd.bench.runner import Progress
from agentd.bench.workload import Namespace, Prompts, Workload

NUM_COLD = 3  # every request is cold here; the first few stand for "cold TTFT"


class _FirstTokenTimer:
    """A ``generate`` streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.first_token_at: float | None = None
        self._num_puts = 0

    def put(self, value: Any) -> None:
        self._num_puts += 1  # the first put is the prompt itself
        if self._num_puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf_baseline(model_path: str | None, workload: Workload, num_requests: int,
                    max_tokens: int, progress: Progress) -> BaselineResult:
    """Load the model with transformers and run ``num_requests`` prompts sequentially."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from agentd.chat import render_chat
    from agentd.model.loader import load_tokenizer, resolve_model

    files = resolve_model(model_path)
    tokenizer = load_tokenizer(files)
    progress.phase(f"{workload.name}: HF baseline (loading {files.name})", num_requests + 1)
    hf_logging.disable_progress_bar()  # ours is on screen
    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        tokenizer.eos_token_id

    def generate(token_ids: list[int], new_tokens: int) -> RequestResult:
        ids = torch.tensor([token_ids])
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad_id, streamer=timer)
        end = time.perf_counter()
        ttft = timer.first_token_at - start if timer.first_token_at is not None else None
        return RequestResult("baseline", ttft, end - start, len(token_ids), 0,
                             out.shape[1] - ids.shape[1], start)

    prompts = Prompts(workload)
    generate(tokenizer("Hello", add_special_tokens=False).input_ids, 2)  # warm-up, uncounted
    progress.advance()
    results = []
    wall_start = time.perf_counter()
    for _ in range(num_requests):
        messages, tools = prompts.single_turn(Namespace())
        rendered = render_chat(tokenizer, messages, tools or None)
        results.append(generate(rendered.prompt_token_ids, max_tokens))
        progress.advance()
    wall_s = time.perf_counter() - wall_start
    # The high-water mark of this process: the model, the tokenizer and generate's peak.
    return BaselineResult(model_path=str(files.path), results=results, wall_s=wall_s,
                          num_cold=min(NUM_COLD, len(results)),
                          peak_rss_bytes=read_status_bytes(os.getpid(), "VmHWM"))
