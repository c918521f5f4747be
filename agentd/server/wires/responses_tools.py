"""The tools a Responses request brings, as the function tools the templates and constraints
take, and the model's calls mapped back to the client's own tools.

Codex sends more than function tools: ``namespace`` tools that group functions (in ``tools`` or
in an ``additional_tools`` input item), ``custom`` tools whose input is free text, and hosted
tools (``web_search``...) that OpenAI runs on its side.

Invariants: a namespace's functions become function tools of their own names (a name two
namespaces share is ``<namespace>__<name>``), and a call to one is a ``function_call`` item
naming its ``namespace``; a custom tool becomes a function of one string argument, ``input``,
and a call to it is a ``custom_tool_call`` item carrying that text; a hosted tool cannot run here
and leaves the prompt, said in the reply's ignored fields; a tool of a type not listed here is a
400 naming it. The model sees each tool once, under one name, whatever its origin.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.ignored_fields import Ignored
from agentd.server.wires.checks import FUNCTION_NAME
from agentd.server.wires.responses_types import CallItem, CustomToolCallItem, FunctionCallItem
from agentd.server.wires.tools import ToolSet, responses_tools

# Tools OpenAI runs on its own servers: nothing here can run them.
HOSTED = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                    "file_search", "code_interpreter", "image_generation",
                    "computer_use_preview", "computer_use", "mcp", "local_shell", "tool_search"})
_CUSTOM_INPUT = "input"


@dataclass(frozen=True)
class ToolOrigin:
    """What the client called a tool the model sees under another (flat) name."""

    name: str
    namespace: str | None = None
    custom: bool = False  # free-text input: its calls are ``custom_tool_call`` items


@dataclass(frozen=True)
class ResponsesTools:
    tool_set: ToolSet
    origins: Mapping[str, ToolOrigin] = field(default_factory=dict)  # flat name -> origin
    ignored: tuple[Ignored, ...] = ()

    def flat_name(self, name: str, namespace: str | None) -> str:
        """The name the model knows a client's tool by (history items name it as sent)."""
        for flat, origin in self.origins.items():
            if origin.name == name and origin.namespace == namespace:
                return flat
        return name

    def origin(self, flat: str) -> ToolOrigin:
        return self.origins.get(flat) or ToolOrigin(flat)


def additional_tools(items: Any) -> list[tuple[str, Any]]:
    """The tools of ``input``'s ``additional_tools`` items, each with its path."""
    if not isinstance(items, list):
        return []
    out: list[tuple[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            where = f"input[{i}].tools"
            out += [(f"{where}[{j}]", tool) for j, tool in enumerate(
                _as_list(item.get("tools"), where))]
    return out


def parse_tools(tools: Any, extra: Iterable[tuple[str, Any]], tool_choice: Any,
                parallel: bool | None) -> ResponsesTools:
    """``tools`` and the tools of ``additional_tools`` items (``extra``), flattened."""
    flat: list[tuple[str, dict[str, Any], ToolOrigin]] = []  # (where, function tool, origin)
    ignored: list[Ignored] = []
    listed = [(f"tools[{i}]", t) for i, t in enumerate(_as_list(tools, "tools"))] + list(extra)
    for path, tool in listed:
        if not isinstance(tool, dict):
            raise Invalid(f"{path} must be a tool object", path)
        kind = tool.get("type")
        if kind in HOSTED:
            ignored.append(Ignored(f"{path} ({kind})", f"a {kind} tool runs on OpenAI's side; "
                                   "it cannot run here and was left out of the prompt"))
        elif kind == "namespace":
            flat += _namespace(tool, path)
        elif kind in ("function", "custom"):
            flat.append((path, *_one(tool, None)))
        else:
            raise Invalid(f"{path}.type {kind!r} is not supported: agentd runs function, "
                          "custom and namespace tools (hosted tools are left out)",
                          f"{path}.type")
    names = [origin.name for _, _, origin in flat]
    origins: dict[str, ToolOrigin] = {}
    functions: list[dict[str, Any]] = []
    for _, function, origin in flat:
        name = origin.name if names.count(origin.name) == 1 or origin.namespace is None \
            else f"{origin.namespace}__{origin.name}"[:64]
        functions.append({**function, "name": name})
        if name != origin.name or origin.namespace is not None or origin.custom:
            origins[name] = origin
    return ResponsesTools(responses_tools(functions or None, tool_choice, parallel),
                          origins, tuple(ignored))


def call_item(tools: ResponsesTools, item_id: str, call_id: str, flat: str, arguments: str,
              status: str = "completed") -> CallItem:
    """A call of the model's as the client's item: a ``function_call`` (naming its
    ``namespace``) or a ``custom_tool_call`` carrying its text."""
    origin = tools.origin(flat)
    if origin.custom:
        return CustomToolCallItem(id=item_id, call_id=call_id, name=origin.name,
                                  input=custom_input(arguments), status=status,
                                  namespace=origin.namespace)
    return FunctionCallItem(id=item_id, call_id=call_id, name=origin.name, arguments=arguments,
                            status=status, namespace=origin.namespace)


def history_calls(tools: ResponsesTools, output: Iterable[Any]) -> list[dict[str, Any]]:
    """A reply's calls as the assistant's tool calls the model made (for a continuation)."""
    calls = []
    for item in output:
        if isinstance(item, FunctionCallItem):
            arguments = item.arguments
        elif isinstance(item, CustomToolCallItem):
            arguments = custom_arguments(item.input)
        else:
            continue
        calls.append({"id": item.call_id, "type": "function", "function": {
            "name": tools.flat_name(item.name, item.namespace), "arguments": arguments}})
    return calls


def custom_input(arguments: str) -> str:
    """A custom tool's free text, out of the one-argument JSON the model wrote."""
    try:
        value = json.loads(arguments).get(_CUSTOM_INPUT, "")
    except (ValueError, AttributeError):
        return arguments  # cut short mid-arguments: what there is
    return value if isinstance(value, str) else json.dumps(value)


def custom_arguments(text: str) -> str:
    """A custom call of the history as the function call the model made."""
    return json.dumps({_CUSTOM_INPUT: text})


def _namespace(tool: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any], ToolOrigin]]:
    namespace = tool.get("name")
    if not isinstance(namespace, str) or not FUNCTION_NAME.match(namespace):
        raise Invalid(f"{path}.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-', got "
                      f"{namespace!r}", f"{path}.name")
    out = []
    for j, inner in enumerate(_as_list(tool.get("tools"), f"{path}.tools")):
        where = f"{path}.tools[{j}]"
        if not isinstance(inner, dict) or inner.get("type") not in ("function", "custom"):
            kind = inner.get("type") if isinstance(inner, dict) else inner
            raise Invalid(f"{where}.type {kind!r} is not supported inside a namespace: function "
                          "and custom tools are", f"{where}.type")
        out.append((where, *_one(inner, namespace)))
    return out


def _one(tool: dict[str, Any], namespace: str | None) -> tuple[dict[str, Any], ToolOrigin]:
    """A function or custom tool as a Responses function tool, and where it came from."""
    name = tool.get("name")
    if tool.get("type") == "function":
        return dict(tool), ToolOrigin(name, namespace)
    description = tool.get("description")
    parameters = {"type": "object", "required": [_CUSTOM_INPUT], "additionalProperties": False,
                  "properties": {_CUSTOM_INPUT: {"type": "string"}}}
    function = {"type": "function", "name": name, "parameters": parameters}
    if description is not None:
        function["description"] = description
    return function, ToolOrigin(name, namespace, custom=True)


def _as_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise Invalid(f"{where} must be a list of tools", where)
    return value
