"""Prompt-lookup speculative decoding: drafts from a request's own tokens, no draft model.

Agents copy paths, identifiers, JSON keys and whole code spans from their context. After each
step, a decoding request whose last n tokens (``ngram_max`` down to ``ngram_min``) occurred
earlier in its prompt or output gets the up to k tokens that followed the most recent such
occurrence as a draft (``Request.spec_token_ids``). The scheduler runs the draft beside the
request's next token in one forward (the multi-token path over the paged KV); the runner returns
the logits after each of those tokens, and :meth:`Speculator.sample` keeps the draft tokens the
model agrees with, plus one token of its own.

Invariant: speculation never changes what a request outputs.
- Greedy: a draft token is kept only while it equals the argmax after the tokens before it.
- Sampled: every emitted token is drawn from the target distribution (temperature, top-k, top-p)
  after the tokens before it, with the request's own generator, one draw per emitted token, and a
  draft token is kept only when the draw equals it. This is the speculative-sampling rejection
  rule for a draft distribution q that puts all its mass on the draft token d: accept with
  probability min(1, p(d)/q(d)) = p(d); on rejection draw from norm(max(0, p - q)), which is p
  without d. Drawing x ~ p and keeping d iff x == d has exactly these probabilities, and it
  spends the generator as plain decoding does, so a seeded request gets the same tokens whether
  it speculated or not.
Requests that speculation could not keep exact never draft (:func:`can_speculate`).

Adaptive: no drafts in a step that is compute-bound already (more than ``max_num_seqs`` running
requests, or a prefill chunk or a waiting request in the batch). Per request, a draft accepted
whole doubles the next draft's length (up to ``num_tokens``), one accepted in part sets it to
one more than was accepted, and one rejected outright halves it and makes the request wait 1,
2, 4 ... up to ``MAX_BACKOFF_STEPS`` steps before drafting again: long drafts while the reply
copies its context, short and rare ones while it does not.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentd.config import SpeculativeConfig
from agentd.engine.hooks import RequestHooks
from agentd.engine.request import Request
from agentd.engine.sampler import Sampler

if TYPE_CHECKING:
    from agentd.engine.outputs import StreamDelta
    from agentd.engine.scheduler import ScheduledRequest

MAX_BACKOFF_STEPS = 32
_ITEM_BYTES = array("i").itemsize


def can_speculate(request: Request) -> bool:
    """Whether drafts can be verified for this request without changing its output. Left out:
    penalties (a row's penalty would depend on the drafts accepted before it). Constrained
    requests draft too: the engine cuts a draft where their grammar refuses it and masks each
    draft row with the grammar's state after the draft tokens before it
    (``agentd.structured.matchers``)."""
    params = request.params
    return not (params.presence_penalty or params.frequency_penalty)


def propose_ngram(token_ids: Sequence[int], num_tokens: int, ngram_max: int,
                  ngram_min: int) -> list[int]:
    """The up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``token_ids`` of ``ngram_max`` down to ``ngram_min`` tokens; [] if none."""
    data = array("i", token_ids).tobytes()
    num = len(token_ids)
    for n in range(min(ngram_max, num - 1), ngram_min - 1, -1):
        pattern = data[(num - n) * _ITEM_BYTES:]
        # The occurrence must end before the last token: the suffix itself is no match, and a
        # token has to follow it.
        pos = data.rfind(pattern, 0, (num - 1) * _ITEM_BYTES)
        while pos > 0 and pos % _ITEM_BYTES:  # a match across token boundaries: look earlier
            pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
        if pos >= 0:
            start = pos // _ITEM_BYTES + n
            return list(token_ids[start:start + num_tokens])
    return []


@dataclass
class SpecStats:
    num_drafts: int = 0  # requests' steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Speculator(RequestHooks):
    """Speculation off (the null implementation): never drafts; samples one token a request."""

    def __init__(self) -> None:
        self.stats = SpecStats()

    def propose(self, running: Sequence[Request], num_waiting: int) -> None:
        """Set ``spec_token_ids`` of the running requests that should draft next step."""

    def finished(self, request: Request, item: ScheduledRequest | None,
                 delta: StreamDelta) -> None:
        """Drop what is kept about a finished request."""
        self.forget(request.request_id)

    def forget(self, request_id: str) -> None:
        """Drop what is kept about ``request_id``."""

    def sample(self, sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request],
               drafts: Mapping[str, list[int]]) -> dict[str, list[int]]:
        """New tokens per request: its accepted draft tokens, then one sampled token.

        Args:
            sampler: draws the tokens (greedy or with the request's generator).
            logits: the runner's rows: per request, 1 + ``len(drafts[request_id])`` of them.
            requests: the sampling requests, in the order of their rows.
            drafts: the draft tokens run this step, by request id (absent: none).
        """
        if not drafts:
            return {r.request_id: [t] for r, t in zip(requests, sampler.sample(logits, requests),
                                                      strict=True)}
        tokens: dict[str, list[int]] = {}
        plain_rows, plain_requests = [], []
        row = 0
        for request in requests:
            draft = drafts.get(request.request_id, [])
            if draft:
                tokens[request.request_id] = verify(sampler, logits[row:row + len(draft) + 1],
                                                    request, draft)
                self._record(request.request_id, len(draft),
                             len(tokens[request.request_id]) - 1)
            else:
                plain_rows.append(row)
                plain_requests.append(request)
            row += len(draft) + 1
        if plain_requests:
            rows = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
            for request, token in zip(plain_requests, sampler.sample(rows, plain_requests),
                                      strict=True):
                tokens[request.request_id] = [token]
        return tokens

    def _record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafted
        self.stats.num_accepted_tokens += num_accepted


def verify(sampler: Sampler, logits: torch.Tensor, request: Request,
           draft: list[int]) -> list[int]:
    """The draft tokens the model agrees with, then its own next token (module docstring).

    ``logits[i]`` follows the request's tokens and ``draft[:i]``.
    """
    if request.params.greedy:
        targets = sampler.sample(logits, [request] * len(logits))
        num_accepted = next((i for i, d in enumerate(draft) if d != targets[i]), len(draft))
        return targets[:num_accepted + 1]
    tokens = []
    for i in range(len(draft) + 1):
        tokens.append(sampler.sample(logits[i:i + 1], [request])[0])
        if i == len(draft) or tokens[-1] != draft[i]:
            break
    return tokens


@dataclass
class _Drafting:
    num_tokens: int  # the next draft's length
    wait_steps: int = 0  # steps to sit out before the next draft
    next_wait_steps: int = 1  # what the next outright rejection costs


class NgramSpeculator(Speculator):
    """Prompt lookup (module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__()
        self.config = config
        self._drafting: dict[str, _Drafting] = {}

    def propose(self, running: Sequence[Request], num_waiting: int) -> None:
        if num_waiting or len(running) > self.config.max_num_seqs or any(
                r.num_tokens - r.num_computed_tokens > 1 for r in running):
            return  # compute-bound: draft rows would cost as much as any other row
        for request in running:
            state = self._state(request.request_id)
            if state.wait_steps:
                state.wait_steps -= 1
                continue
            room = request.max_output_tokens - request.num_output_tokens - 1
            if can_speculate(request) and room > 0:
                request.spec_token_ids = propose_ngram(
                    request.all_token_ids, min(state.num_tokens, room),
                    self.config.ngram_max, self.config.ngram_min)

    def _state(self, request_id: str) -> _Drafting:
        state = self._drafting.get(request_id)
        if state is None:
            state = self._drafting[request_id] = _Drafting(self.config.num_tokens)
        return state

    def _record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        super()._record(request_id, num_drafted, num_accepted)
        state = self._state(request_id)
        if num_accepted == num_drafted:
            state.num_tokens = min(2 * num_drafted, self.config.num_tokens)
        elif num_accepted:
            state.num_tokens = num_accepted + 1
        else:
            state.num_tokens = max(num_drafted // 2, 1)
            state.wait_steps = state.next_wait_steps
            state.next_wait_steps = min(2 * state.next_wait_steps, MAX_BACKOFF_STEPS)
            return
        state.next_wait_steps = 1

    def forget(self, request_id: str) -> None:
        self._drafting.pop(request_id, None)


def make_speculator(config: SpeculativeConfig) -> Speculator:
    return NgramSpeculator(config) if config.method == "ngram" else Speculator()
