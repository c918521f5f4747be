"""Agent workloads for the benchmark: load, trim to a prompt-token budget, and build requests.

Trimming rule (``trim_to_budget``), for a budget of N prompt tokens per request:

1. tools: the first k tools (k >= 1 when the workload has any) whose schemas, as the tools block
   shows them (one canonical JSON object per line), total nearest to N/4 tokens;
2. system: the longest run of whole paragraphs, then the longest run of words of the next
   paragraph, such that the request rendered with the workload's median-length user turn is at
   most N tokens;
3. when the whole system text fits, the following tools too, as many as stay within N.

So the budget is a ceiling that a request with the median turn meets to within a few tokens
(a word) when the system text is cut, and to within one tool schema when it is not; a workload
smaller than the budget is sent whole.

Invariants: trimming never reorders or edits tools or turns (it only drops tools from the end
and cuts the system text), so trimmed requests are a prefix-compatible subset of the originals;
every request of one namespace shares the exact same system text and tools, byte for byte;
user turns never repeat within a run (a turn reused after the list runs out carries its request
number).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from agentd.chat import render_chat, tools_json

PACKAGED = ("coding_agent", "research_agent", "support_agent", "code_edit_agent")
DEFAULT_PROMPT_TOKENS = 2100
TOOLS_SHARE = 4  # tools get about 1/TOOLS_SHARE of the budget (500 of ~2,100)

Message = dict[str, Any]


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Workload:
    name: str
    system: str
    tools: list[dict[str, Any]]
    turns: list[str]
    conversations: list[list[Message]] = field(default_factory=list)
    num_tools_total: int = 0  # before trimming
    system_chars_total: int = 0  # before trimming


@dataclass(frozen=True)
class Namespace:
    """Where a request's prefix lives in the server's cache.

    ``salt`` is sent as ``cache_salt`` (agentd, vLLM); ``nonce`` is written into the system text
    and the first tool's description instead, for servers without cache salts. Neither: the
    plain prefix (the one a pin covers).
    """

    salt: str | None = None
    nonce: str | None = None


def packaged_path(name: str) -> Path:
    return Path(str(resources.files("agentd.workloads").joinpath(f"{name}.json")))


def load_workload(path: Path) -> Workload:
    """Read and check a workload JSON file (format: agentd/workloads/README.md)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise WorkloadError(f"workload {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("system"), str):
        raise WorkloadError(f"workload {path} needs a \"system\" string (see the workload README)")
    turns = data.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise WorkloadError(f"workload {path} needs a non-empty \"turns\" list of strings")
    tools = data.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise WorkloadError(f"workload {path}: \"tools\" must be a list of OpenAI tool objects")
    return Workload(name=str(data.get("name") or Path(path).stem), system=data["system"],
                    tools=tools, turns=turns, conversations=data.get("conversations") or [],
                    num_tools_total=len(tools), system_chars_total=len(data["system"]))


def opening_turns(workload: Workload, count: int) -> list[str]:
    """The first ``count`` messages that open a request of ``workload``: its single turns, then
    its conversations' first user messages."""
    firsts = [c[0]["content"] for c in workload.conversations if c and c[0]["role"] == "user"]
    return (workload.turns + firsts)[:count]


def median_turn(workload: Workload, tokenizer: Any) -> str:
    by_len = sorted(workload.turns, key=lambda t: len(_ids(tokenizer, t)))
    return by_len[len(by_len) // 2]


def prompt_len(tokenizer: Any, system: str, tools: list[dict[str, Any]], turn: str) -> int:
    """Prompt tokens of one request, rendered with the model's chat template."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": turn}]
    return len(render_chat(tokenizer, messages, tools or None).prompt_token_ids)


def trim_to_budget(workload: Workload, tokenizer: Any, budget: int) -> Workload:
    """The workload cut down to ``budget`` prompt tokens per request (see the module rule)."""
    turn = median_turn(workload, tokenizer)
    tools = _budget_tools(workload, tokenizer, budget, turn)
    system = _budget_system(workload.system, lambda s: prompt_len(tokenizer, s, tools, turn),
                            budget)
    if system == workload.system:
        more = workload.tools[len(tools):]
        k = _longest(len(more), lambda n: prompt_len(tokenizer, system, tools + more[:n],
                                                      turn) <= budget)
        tools = tools + more[:k]
    return replace(workload, system=system, tools=tools)


def _budget_tools(workload: Workload, tokenizer: Any, budget: int,
                  turn: str) -> list[dict[str, Any]]:
    tools = workload.tools
    if not tools:
        return []
    totals = [len(_ids(tokenizer, tools_json(tools[:k]))) for k in range(1, len(tools) + 1)]
    target = budget / TOOLS_SHARE
    k = 1 + min(range(len(totals)), key=lambda i: (abs(totals[i] - target), i))
    while k > 0 and prompt_len(tokenizer, "", tools[:k], turn) > budget:
        k -= 1
    return tools[:k]


def _budget_system(system: str, length: Callable[[str], int], budget: int) -> str:
    if length(system) <= budget:
        return system
    paragraphs = system.split("\n\n")
    p = _longest(len(paragraphs), lambda n: length("\n\n".join(paragraphs[:n])) <= budget)
    kept = "\n\n".join(paragraphs[:p])
    words = paragraphs[p].split(" ")
    joiner = "\n\n" if p else ""
    w = _longest(len(words), lambda n: length(kept + joiner + " ".join(words[:n])) <= budget)
    return kept + joiner + " ".join(words[:w]) if w else kept


def _longest(n: int, fits: Callable[[int], bool]) -> int:
    """The largest k in [0, n] with fits(k), for a predicate true up to some k and false after
    (fits(0) is taken as true)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


class Prompts:
    """Requests of one workload: distinct user turns, the same prefix per namespace."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._num_turns_used = 0

    def next_turn(self) -> str:
        k = self._num_turns_used
        self._num_turns_used += 1
        turns = self.workload.turns
        turn = turns[k % len(turns)]
        return turn if k < len(turns) else f"{turn} (request {k})"

    def prefix(self, namespace: Namespace) -> tuple[str, list[dict[str, Any]]]:
        """The system text and tools of ``namespace``."""
        system, tools = self.workload.system, self.workload.tools
        if namespace.nonce is None:
            return system, tools
        # The nonce goes into both: templates put the tools before or after the system text.
        system = f"Session {namespace.nonce}.\n\n{system}"
        if tools:
            first = copy.deepcopy(tools[0])
            function = first.setdefault("function", {})
            function["description"] = f"[{namespace.nonce}] {function.get('description', '')}"
            tools = [first, *tools[1:]]
        return system, tools

    def single_turn(self, namespace: Namespace) -> tuple[list[Message], list[dict[str, Any]]]:
        """Messages (system + a new user turn) and tools of one request."""
        system, tools = self.prefix(namespace)
        return [{"role": "system", "content": system},
                {"role": "user", "content": self.next_turn()}], tools

    def conversation_steps(self, index: int,
                           namespace: Namespace) -> list[tuple[list[Message], list[dict]]]:
        """Each point of conversation ``index`` where the model speaks next, as a request."""
        system, tools = self.prefix(namespace)
        conversation = self.workload.conversations[index]
        ends = [i for i, m in enumerate(conversation) if i and m.get("role") == "assistant"]
        ends.append(len(conversation))
        head = [{"role": "system", "content": system}]
        return [(head + conversation[:end], tools) for end in ends]
