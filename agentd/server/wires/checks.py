"""The checks every wire shares, below the wires' own types: a request error that names its field,
the ranges of the sampling fields, tool schemas, and the prompt's length against the context.

Invariant: a check raises ``RequestValidationError`` naming the ``param`` the client must fix
(the path its wire spells, handed in by the caller) and changes nothing; every wire renders that
error in its own shape. Nothing here imports a wire's types.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
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


def validate_prompt_len(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                        param: str = "messages", max_tokens_param: str = "max_tokens") -> None:
    """Reject a rendered prompt that leaves no room, or too little room, to generate: a 400 with
    OpenAI's code ``context_length_exceeded`` that names both numbers (what SDKs and agent
    frameworks look for to trim a conversation)."""
    if num_prompt_tokens >= max_model_len:
        raise RequestValidationError(
            f"the prompt is {num_prompt_tokens} tokens, but the model's context length "
            f"(max_model_len) is {max_model_len} tokens; shorten the {param}",
            param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise RequestValidationError(
            f"the prompt ({num_prompt_tokens} tokens) plus {max_tokens_param} ({max_tokens}) "
            f"exceeds max_model_len ({max_model_len}); lower {max_tokens_param}",
            max_tokens_param,
            code="context_length_exceeded",
        )


def check_max_tokens(value: int, name: str, max_model_len: int) -> None:
    if value <= 0:
        raise RequestValidationError(f"{name} must be at least 1, got {value}", name)
    if value > max_model_len:
        raise RequestValidationError(
            f"{name} must be at most max_model_len ({max_model_len}), got {value}", name
        )


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


def check_sampling(req: Any, max_model_len: int) -> None:
    """The OpenAI sampling fields chat and text completions share (``n``, ``max_tokens``,
    temperature, nucleus, penalties, seed, ``top_k``, ``logit_bias``, ``stop``)."""
    if req.n is not None and req.n != 1:
        raise RequestValidationError(
            f"n must be 1 (only one choice is supported), got {req.n}", "n"
        )
    if req.max_tokens is not None:
        check_max_tokens(req.max_tokens, "max_tokens", max_model_len)
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
