"""Tools and ``tool_choice`` of the Responses and Messages wires, as the chat route's OpenAI
shape, so both reach the same templates and ``agentd.structured`` constraint.

Invariants: only function tools pass (Responses ``{"type": "function", "name", "parameters"}``,
Anthropic ``{"name", "input_schema"}``); any other kind (web search, computer use, MCP...) is a
400 naming it. Names are unique and well-formed, schemas are JSON Schema objects, and a named
``tool_choice`` names one of the tools. Anthropic's choices map onto OpenAI's: ``any`` is
``required``, ``tool`` is a named function, ``disable_parallel_tool_use`` is
``parallel_tool_calls: false`` (and an explicit ``false`` asks for parallel calls); as on
chat, a turn holds one call unless parallel calls are asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.wires.checks import FUNCTION_NAME, check_parameters


@dataclass(frozen=True)
class ToolSet:
    tools: list[dict[str, Any]] | None  # OpenAI chat shape
    tool_choice: str | dict[str, Any] | None  # OpenAI chat shape
    parallel: bool | None

    @property
    def on(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _function(name: Any, description: Any, schema: Any, strict: Any, where: str,
              schema_field: str, seen: set[str]) -> dict[str, Any]:
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise Invalid(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-', got "
                      f"{name!r}", f"{where}.name")
    if name in seen:
        raise Invalid(f"{where}.name {name!r} is used by more than one tool", f"{where}.name")
    seen.add(name)
    if schema is not None and not isinstance(schema, dict):
        raise Invalid(f"{where}.{schema_field} must be a JSON Schema object",
                      f"{where}.{schema_field}")
    check_parameters(schema, f"{where}.{schema_field}")
    function: dict[str, Any] = {"name": name, "parameters": schema or {"type": "object"}}
    if description is not None:
        function["description"] = str(description)
    if strict is not None:
        function["strict"] = bool(strict)
    return {"type": "function", "function": function}


def _tool_list(tools: Any, where: str = "tools") -> list[Any]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Invalid(f"{where} must be a list of tool objects", where)
    return tools


def responses_tools(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolSet:
    """Responses API function tools and ``tool_choice``."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(_tool_list(tools)):
        kind = tool.get("type")
        if kind != "function":
            raise Invalid(f"tools[{i}].type {kind!r} is not supported: agentd runs function "
                          "tools only", f"tools[{i}].type")
        out.append(_function(tool.get("name"), tool.get("description"), tool.get("parameters"),
                             tool.get("strict"), f"tools[{i}]", "parameters", seen))
    choice: str | dict[str, Any] | None
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    else:
        raise Invalid("tool_choice must be 'auto', 'none', 'required' or {\"type\": "
                      f"\"function\", \"name\": ...}}, got {tool_choice!r}", "tool_choice")
    return _checked(ToolSet(out or None, choice, parallel), seen)


def anthropic_tools(tools: Any, tool_choice: Any) -> ToolSet:
    """Anthropic client tools (``input_schema``) and ``tool_choice``."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(_tool_list(tools)):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise Invalid(f"tools.{i}.type {kind!r} is not supported: agentd runs client tools "
                          "(name, description, input_schema) only", f"tools.{i}.type")
        if "input_schema" not in tool:
            raise Invalid(f"tools.{i}.input_schema: Field required", f"tools.{i}.input_schema")
        out.append(_function(tool.get("name"), tool.get("description"), tool["input_schema"],
                             None, f"tools.{i}", "input_schema", seen))
    if tool_choice is None:
        return ToolSet(out or None, None, None)
    if not isinstance(tool_choice, dict) or tool_choice.get("type") not in (
            "auto", "any", "tool", "none"):
        raise Invalid("tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}, "
                      f"got {tool_choice!r}", "tool_choice")
    kind = tool_choice["type"]
    choice: str | dict[str, Any] = {"auto": "auto", "any": "required", "none": "none"}.get(
        kind) or {"type": "function", "function": {"name": tool_choice.get("name")}}
    # disable_parallel_tool_use false is the one way to ask for several calls (see above)
    disable = tool_choice.get("disable_parallel_tool_use")
    parallel = None if disable is None else not disable
    return _checked(ToolSet(out or None, choice, parallel), seen)


def _checked(tool_set: ToolSet, names: set[str]) -> ToolSet:
    choice = tool_set.tool_choice
    if choice in (None, "auto", "none"):
        return tool_set
    if not names:
        raise Invalid("tool_choice requires tools; pass tools or omit tool_choice", "tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise Invalid(f"tool_choice names the tool {choice['function']['name']!r}, which is not "
                      f"in tools ({', '.join(sorted(names))})", "tool_choice")
    return tool_set
