"""The output processor: after each forward, the one place that turns a step's sampled tokens
into a request's output and decides whether the request has finished, and why.

Each step, per sampling request (:meth:`OutputProcessor.process`): its new tokens are appended
one by one, each checked against the output constraint and the stop conditions, the first that
ends the request being its last; then the tokens a grammar forces are appended (jump-forward);
then the new tokens are detokenized and the text searched for stop strings, and tokens past one
are dropped. What was found is an :class:`OutputFacts`, and :func:`finish_for` alone turns it
into the request's :class:`Finish` (or none). The scheduler then frees what a finished request
held; the processor builds each step's :class:`StreamDelta`.

Invariant: finishing is decided once per request per step, by ``finish_for``; emitted text
never contains a stop string, nor a possible start of one that is not yet resolved; a finished
request's tokens end with the token that finished it, or just before its stop string's end.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentd.engine.detokenizer import IncrementalDetokenizer
from agentd.engine.outputs import StreamDelta
from agentd.engine.request import Request, RequestStatus
from agentd.structured.jump_forward import plan_jump

GRAMMAR_DEAD_END = ("the output constraint allows no further token (a grammar dead end); the "
                    "output so far is kept")


@dataclass(frozen=True)
class OutputFacts:
    """What one step's tokens did to a request, as far as finishing goes."""

    grammar_rejected: bool = False  # the constraint allowed no token, or refused the sampled one
    eos: bool = False  # the last token ends the sequence (and ``ignore_eos`` is off)
    stop_token: int | None = None  # the last token is one of ``params.stop_token_ids``
    length: bool = False  # ``max_tokens`` or the model's context is reached
    grammar_ended: bool = False  # the constraint is complete
    stop_string: str | None = None  # a stop string appeared in the text
    tokens_after_stop_string: bool = False  # this step's tokens went past it (they are dropped)


@dataclass(frozen=True)
class Finish:
    status: RequestStatus
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None


def finish_for(facts: OutputFacts) -> Finish | None:
    """Whether, and why, a request is finished after a step: the one place it is decided.

    A grammar dead end fails the request; a stop string ends it when its text came before the
    token that would have ended it otherwise; then an end-of-sequence token, a stop token, the
    length limit, a complete constraint and a stop string, in that order.
    """
    if facts.grammar_rejected:
        return Finish(RequestStatus.FINISHED_ABORTED, error=GRAMMAR_DEAD_END,
                      error_code="grammar_dead_end")
    if facts.stop_string is not None and facts.tokens_after_stop_string:
        return Finish(RequestStatus.FINISHED_STOPPED, facts.stop_string)
    if facts.eos:
        return Finish(RequestStatus.FINISHED_STOPPED)
    if facts.stop_token is not None:
        return Finish(RequestStatus.FINISHED_STOPPED, facts.stop_token)
    if facts.length:
        return Finish(RequestStatus.FINISHED_LENGTH)
    if facts.grammar_ended:
        return Finish(RequestStatus.FINISHED_STOPPED)
    if facts.stop_string is not None:
        return Finish(RequestStatus.FINISHED_STOPPED, facts.stop_string)
    return None


class OutputText:
    """A request's output text as clients may see it: decoded, cut at the first stop string,
    and held back while its end could still be the start of one."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.text = ""  # all output text decoded so far (truncated at a stop string)
        self.num_emitted_chars = 0
        self.stop_reason: str | None = None

    def add_token(self, token_id: int) -> None:
        """Decode one more token; sets ``stop_reason`` when a stop string appears."""
        old_len = len(self.text)
        self.text += self.detokenizer.add_token(token_id)
        if self.stop and len(self.text) > old_len:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        longest = max(len(s) for s in self.stop)
        search_from = max(0, old_len - longest + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        self.stop_reason = stop

    def flush(self, finished: bool) -> str:
        """Text that is safe to emit now; everything left when ``finished``."""
        end = len(self.text)
        if not finished and self.stop and self.stop_reason is None:
            end -= _partial_stop_len(self.text, self.stop)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta


class _NoText:
    """Text for an engine without a tokenizer (scheduler tests): none, and no stop strings."""

    stop_reason = None

    def add_token(self, token_id: int) -> None:
        pass

    def flush(self, finished: bool) -> str:
        return ""


class _Unconstrained:
    """The constraints of an engine without grammars: none."""

    def __contains__(self, request_id: object) -> bool:
        return False


@dataclass
class _State:
    request: Request
    text: OutputText | _NoText
    num_emitted_tokens: int = 0
    num_detokenized: int = 0  # output tokens fed to ``text``
    finish: Finish | None = None


class OutputProcessor:
    """Every live request's output: its text, what was emitted, and how it finished."""

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int, tokenizer: Any = None,
                 structured: Any = None, jump_forward: bool = False) -> None:
        """``structured``: the engine's ``StructuredOutputs`` (the matchers of constrained
        requests); ``jump_forward``: append the tokens a grammar forces without a step each."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.structured = structured if structured is not None else _Unconstrained()
        self.jump_forward = jump_forward
        self.num_jump_forward_tokens = 0  # output tokens a grammar forced, appended without a step
        self._states: dict[str, _State] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add(self, request: Request) -> None:
        params = request.params
        text = _NoText() if self.tokenizer is None else OutputText(
            self.tokenizer, request.prompt_token_ids, params.stop,
            params.include_stop_str_in_output)
        self._states[request.request_id] = _State(request, text)

    def process(self, requests: Sequence[Request], sampled: Mapping[str, Sequence[int]],
                dead_ends: Collection[str] = ()) -> None:
        """Append each request's sampled tokens (its accepted drafts, then one sampled token)
        and decide whether it finished; a finished request's ``status`` says how (the scheduler
        frees its blocks next). ``dead_ends``: requests whose constraint allowed no token."""
        for request in requests:
            state = self._states[request.request_id]
            facts = self._take_tokens(state, sampled[request.request_id],
                                      request.request_id in dead_ends)
            if not facts.grammar_rejected:
                facts = self._take_text(state, facts)
            finish = finish_for(facts)
            if finish is not None:
                state.finish = finish
                request.status = finish.status
                request.stop_reason = finish.stop_reason

    def _take_tokens(self, state: _State, token_ids: Sequence[int],
                     dead_end: bool) -> OutputFacts:
        """Append tokens one by one, as if each came from its own step: the first that would
        end the request is its last. Then what the grammar forces, if nothing ended it."""
        request = state.request
        rid = request.request_id
        constrained = rid in self.structured
        for token_id in token_ids:
            request.append_token(token_id)
            if constrained and (dead_end or not self.structured.accept(rid, token_id)):
                return OutputFacts(grammar_rejected=True)
            facts = self._token_facts(request, token_id, constrained)
            if facts != OutputFacts():
                return facts
        if constrained and self.jump_forward:
            return self._jump(request)
        return OutputFacts()

    def _token_facts(self, request: Request, token_id: int, constrained: bool) -> OutputFacts:
        params = request.params
        return OutputFacts(
            eos=token_id in self.eos_token_ids and not params.ignore_eos,
            stop_token=token_id if token_id in params.stop_token_ids else None,
            length=(request.num_output_tokens >= request.max_output_tokens
                    or request.num_tokens >= self.max_model_len),
            grammar_ended=constrained and self.structured.is_terminated(request.request_id))

    def _jump(self, request: Request) -> OutputFacts:
        """Append the tokens the grammar forces next (see ``agentd.structured.jump_forward``);
        their KV is computed in the next step, with the request's next token, as one chunk."""
        rid = request.request_id
        jump = plan_jump(self.tokenizer, request.output_token_ids,
                         self.structured.forced_text(rid))
        if jump is None:
            return OutputFacts()
        self.structured.rollback(rid, jump.num_replaced)
        del request.all_token_ids[len(request.all_token_ids) - jump.num_replaced:]
        room = request.max_output_tokens - request.num_output_tokens
        for token_id in jump.token_ids[:room]:
            if not self.structured.accept(rid, token_id):
                break  # cannot happen: the grammar forced this text
            request.append_token(token_id)
        self.num_jump_forward_tokens += min(len(jump.token_ids), room) - jump.num_replaced
        return OutputFacts(length=request.num_output_tokens >= request.max_output_tokens)

    def _take_text(self, state: _State, facts: OutputFacts) -> OutputFacts:
        """Detokenize the step's tokens one by one; at a stop string, the tokens after it are
        dropped (a step may have taken several)."""
        request = state.request
        text = state.text
        num_tokens = request.num_prompt_tokens + state.num_detokenized
        for token_id in request.all_token_ids[num_tokens:]:
            text.add_token(token_id)
            num_tokens += 1
            if text.stop_reason is not None:
                break
        state.num_detokenized = num_tokens - request.num_prompt_tokens
        if text.stop_reason is None:
            return facts
        dropped = num_tokens < request.num_tokens
        if dropped:
            request.truncate(num_tokens)
        return OutputFacts(facts.grammar_rejected, facts.eos, facts.stop_token, facts.length,
                           facts.grammar_ended, text.stop_reason, dropped)

    def fail(self, request_id: str, error: str) -> None:
        """The engine finished this request with ``error`` (it can never fit in the pool)."""
        self._states[request_id].finish = Finish(RequestStatus.FINISHED_LENGTH, error=error)

    def request(self, request_id: str) -> Request:
        """A live request (finished ones are forgotten at their last delta)."""
        return self._states[request_id].request

    def delta(self, request_id: str, finished: bool) -> StreamDelta:
        """The request's news since its previous delta; its last when ``finished`` (then the
        processor forgets it)."""
        state = self._states[request_id]
        request = state.request
        new_ids = request.output_token_ids[state.num_emitted_tokens:]
        state.num_emitted_tokens = request.num_output_tokens
        text = state.text.flush(finished)
        error = state.finish.error if finished and state.finish is not None else None
        error_code = state.finish.error_code if error is not None and state.finish else None
        if finished:
            del self._states[request_id]
        return StreamDelta(
            request_id=request_id,
            text=text,
            token_ids=new_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_output_tokens=request.num_output_tokens,
            num_retained_tokens=request.num_retained_tokens,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            error=error,
            error_code=error_code or ("context_length_exceeded" if error else None),
            first_token_time_s=request.first_token_time_s,
            arrival_time_s=request.arrival_time_s,
        )


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
