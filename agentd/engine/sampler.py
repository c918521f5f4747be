"""Token sampling: greedy, temperature, top-k, top-p, penalties and per-request seeds.

Invariant: a request with a seed draws from its own generator, so its tokens do not depend on
what else is in the batch; greedy rows never consume randomness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentd.engine.hooks import RequestHooks
from agentd.engine.request import Request

if TYPE_CHECKING:
    from agentd.engine.outputs import StreamDelta
    from agentd.engine.scheduler import ScheduledRequest


class Sampler(RequestHooks):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def finished(self, request: Request, item: ScheduledRequest | None,
                 delta: StreamDelta) -> None:
        self._generators.pop(request.request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """Pick one token per row of ``logits`` (``[len(requests), vocab]``, float32)."""
        if all(r.params.greedy and not _has_penalty(r) for r in requests):
            return logits.argmax(dim=-1).tolist()
        return [self._sample_row(logits[i], r) for i, r in enumerate(requests)]

    def _sample_row(self, logits: torch.Tensor, request: Request) -> int:
        params = request.params
        if _has_penalty(request):
            logits = _apply_penalties(logits, request)
        if params.greedy:
            return int(logits.argmax())
        logits = logits / params.temperature
        if params.top_k:
            kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            probs = _top_p(probs, params.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator(request)))

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            if request.params.seed is not None:
                gen.manual_seed(request.params.seed)
            else:
                gen.seed()
            self._generators[request.request_id] = gen
        return gen


def _has_penalty(request: Request) -> bool:
    return bool(request.params.presence_penalty or request.params.frequency_penalty)


def _apply_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    output_ids = request.output_token_ids
    if not output_ids:
        return logits
    counts = torch.bincount(torch.tensor(output_ids, device=logits.device),
                            minlength=logits.shape[-1]).to(logits.dtype)
    params = request.params
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(-1)
    drop = cumulative - sorted_probs > top_p  # keep the smallest set whose mass reaches top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
