"""The checks every wire shares, below the wires' own types: a request error that names its field,
the ranges of the sampling fields, tool schemas, and the prompt's length against the context
(``fit_output``: an output cap is clamped to the room left, a prompt that leaves none is a 400 in
the wire's words).

Invariant: a check raises ``RequestValidationError`` naming the ``param`` the client must fix
(the path its wire spells, handed in by the caller) and changes nothing; every wire renders that
error in its own shape. Nothing here imports a wire's types.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from agentd.server.errors import RequestValidationError
from agentd.structured.schema_tree import over_limits

MAX_STOP_SEQUENCES = 4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch generator accepts
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MSGSPEC_PATH = re.compile(r" - at `\$\.?(.*)`$")


RequestT = TypeVar("RequestT", bound=msgspec.Struct)


def decode_request(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Decode a JSON body, turning msgspec's errors into a 400 that names the field."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise _field_error(exc) from exc
    except msgspec.DecodeError as exc:
        raise RequestValidationError(f"request body is not valid JSON: {exc}") from exc


def convert_request(value: Any, request_type: type[RequestT]) -> RequestT:
    """A decoded JSON body as ``request_type``, strictly (``"3"`` is no int, ``"false"`` no
    bool): msgspec's error becomes a 400 that names the field."""
    try:
        return msgspec.convert(value, type=request_type, strict=True)
    except msgspec.ValidationError as exc:
        raise _field_error(exc) from exc


def _field_error(exc: msgspec.ValidationError) -> RequestValidationError:
    """``invalid value for max_tokens: Expected `int`, got `str``` with ``param`` the field."""
    match = _MSGSPEC_PATH.search(str(exc))
    param = match.group(1) if match else None
    if not param:
        return RequestValidationError(str(exc).removesuffix(" - at `$`"))
    reason = str(exc)[:match.start()] if match else str(exc)
    return RequestValidationError(f"invalid value for {param}: {reason}", param=param)


# A prompt that leaves no room in the context, in each wire's own words: clients parse them to
# trim or compact (Claude Code matches Anthropic's ``prompt is too long: N tokens > M``; OpenAI
# clients read the code ``context_length_exceeded``).
OPENAI_TOO_LONG = ("This model's maximum context length is {max_model_len} tokens. However, "
                   "your {param} resulted in {num_tokens} tokens. Please reduce the length of "
                   "the {param}.")
ANTHROPIC_TOO_LONG = "prompt is too long: {num_tokens} tokens > {max_model_len} maximum"


@dataclass(frozen=True)
class OutputRoom:
    """What a request may generate: its cap (asked, or the server's), clamped to the context."""

    max_tokens: int
    asked: int | None  # the client's cap, None when it sent none
    clamped: bool  # the cap asked (or the server's) was more than the context leaves


def fit_output(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
               server_cap: int, param: str = "messages",
               too_long: str = OPENAI_TOO_LONG) -> OutputRoom:
    """The output cap of a rendered prompt: ``max_tokens`` (or ``server_cap`` when the client
    sent none), clamped to the room the context leaves after the prompt, as llama-server and
    Ollama do; a 400 ``context_length_exceeded`` in the wire's words (``too_long``) when the
    prompt itself leaves no room."""
    if num_prompt_tokens >= max_model_len:
        raise RequestValidationError(
            too_long.format(num_tokens=num_prompt_tokens, max_model_len=max_model_len,
                            param=param), param, code="context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    wanted = server_cap if max_tokens is None else max_tokens
    return OutputRoom(min(wanted, room), max_tokens, wanted > room)


def check_max_tokens(value: int, name: str) -> None:
    """An output cap is at least 1; one above the context is clamped at start."""
    if value <= 0:
        raise RequestValidationError(f"{name} must be at least 1, got {value}", name)


def check_range(
    value: float | None, name: str, low: float, high: float, low_open: bool = False
) -> None:
    if value is None:
        return
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestValidationError(f"{name} must be in {interval}, got {value}", name)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def check_sampling(req: Any) -> None:
    """The OpenAI sampling fields chat and text completions share (``n``, ``max_tokens``,
    temperature, nucleus, penalties, seed, ``top_k``, ``logit_bias``, ``stop``)."""
    if req.n is not None and req.n != 1:
        raise RequestValidationError(
            f"n must be 1 (only one choice is supported), got {req.n}", "n"
        )
    if req.max_tokens is not None:
        check_max_tokens(req.max_tokens, "max_tokens")
    check_range(req.temperature, "temperature", 0.0, 2.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise RequestValidationError(
            f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {req.seed}", "seed"
        )
    if req.top_k is not None and req.top_k < 0:
        raise RequestValidationError(
            f"top_k must be >= 0 (0 disables it), got {req.top_k}", "top_k"
        )
    if req.logit_bias:
        raise RequestValidationError("logit_bias is not supported; omit it", "logit_bias")
    stops = stop_list(req.stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestValidationError(
            f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop"
        )
    if any(not s for s in stops):
        raise RequestValidationError("stop sequences must be non-empty strings", "stop")


def check_tools(tools: Sequence[Any]) -> list[str]:
    """OpenAI function tools (``type``, ``function.name``, ``function.parameters``): valid and
    distinct names, object schemas; returns the names."""
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise RequestValidationError(
                f"{where}.type must be 'function', got {tool.type!r}", f"{where}.type"
            )
        name = tool.function.name
        if not FUNCTION_NAME.match(name):
            raise RequestValidationError(
                f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-', "
                f"got {name!r}",
                f"{where}.function.name",
            )
        if name in names:
            raise RequestValidationError(
                f"{where}.function.name {name!r} is used by more than one tool",
                f"{where}.function.name",
            )
        check_parameters(tool.function.parameters, f"{where}.function.parameters")
        names.append(name)
    return names


def check_parameters(parameters: dict[str, Any] | None, where: str) -> None:
    if parameters is None:
        return
    if parameters.get("type", "object") != "object":
        raise RequestValidationError(
            f'{where} must be a JSON Schema object ({{"type": "object", ...}}), got type '
            f"{parameters.get('type')!r}",
            where,
        )
    if not isinstance(parameters.get("properties", {}), dict):
        raise RequestValidationError(f"{where}.properties must be an object", where)
    problem = over_limits(parameters)  # before the chat template renders it
    if problem is not None:
        raise RequestValidationError(f"{where} is too large to compile: {problem}", where)
