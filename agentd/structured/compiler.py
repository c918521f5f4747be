"""Compile structured-output params into grammars for one tokenizer, with a cache.

Invariant: a params ``key`` compiles once per compiler (an agent sends the same tools with every
request, so only its first request compiles); later requests get the cached grammar. Any thread
may call ``compile`` (it holds a lock, and xgrammar releases the GIL while it works), so the
server compiles off the event loop and off the engine thread. A constraint the engine cannot
compile raises ``GrammarError`` with the engine's reason and nothing is cached; so does a JSON
schema, before xgrammar sees it, that is over the size limits (``schema_tree``), has a part
with no finite instance (``finite``) or, when strict, a keyword the grammar cannot enforce
(``enforced``).

The grammar engine is xgrammar, chosen by measurement (benchmarks/grammar_engines.py): its
structural tags express a triggered tool-call turn directly, and its masks cost ~5 us a row.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from agentd.structured.enforced import check_enforced
from agentd.structured.finite import no_finite_instance
from agentd.structured.formats import tighten_formats
from agentd.structured.params import (
    CALL_CLOSING,
    CALL_SEPARATOR,
    JSON_SEPARATORS,
    TOOL_CALL_OPEN,
    FunctionSpec,
    GrammarError,
    StructuredOutputsParams,
    ToolCallsSpec,
    call_opening,
    check_limits,
)
from agentd.structured.repetition import bound_numbers

MAX_CACHED_GRAMMARS = 128
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Params -> compiled xgrammar grammars for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached = max_cached
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_s_total = 0.0
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        self._compiler: Any = None  # built on first use: the tokenizer info takes ~0.7 s
        self._info: Any = None

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``params``; raises GrammarError when it cannot compile."""
        with self._lock:
            cached = self._cache.get(params.key)
            if cached is not None:
                self._cache.move_to_end(params.key)
                self.num_cache_hits += 1
                return cached
            start = time.perf_counter()
            compiled = self._build(params)
            self.compile_s_total += time.perf_counter() - start
            self.num_compiled += 1
            self._cache[params.key] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return compiled

    def decoded_vocab(self) -> list[bytes]:
        """Each token id's bytes, as the grammar engine sees them."""
        self._xgr_compiler()
        return list(self._info.decoded_vocab)

    def _xgr_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            self._info = info
        return self._compiler

    def _build(self, params: StructuredOutputsParams) -> Any:
        compiler = self._xgr_compiler()
        kind = params.kind
        try:
            if kind == "tool_calls":
                assert params.tool_calls is not None
                return compiler.compile_structural_tag(tool_calls_tag(params.tool_calls))
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else {"type": "object"}
                return compiler.compile_grammar(_json_grammar(schema, "the JSON schema",
                                                              params.any_whitespace,
                                                              params.strict))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                assert params.choice is not None
                alternatives = " | ".join(_ebnf_string(c) for c in params.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(params.grammar)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            raise GrammarError(_reason(exc)) from exc


def tool_calls_tag(spec: ToolCallsSpec) -> Any:
    """The structural tag of a tool-call turn: ``<tool_call>\\n{"name": N, "arguments": A}\\n
    </tool_call>`` blocks joined by newlines, with A valid against N's parameters."""
    from xgrammar import structural_tag as st

    tags = [st.TagFormat(begin=call_opening(f.name),
                         content=st.GrammarFormat(grammar=_arguments_grammar(f)),
                         end=CALL_CLOSING)
            for f in spec.functions]
    calls = st.TagsWithSeparatorFormat(tags=tags, separator=CALL_SEPARATOR,
                                       at_least_one=(spec.mode == "required"
                                                     or spec.answer_schema is not None),
                                       stop_after_first=not spec.parallel)
    if spec.answer_schema is not None:
        answer = st.GrammarFormat(grammar=_json_grammar(json.loads(spec.answer_schema),
                                                        "the response format's schema",
                                                        strict=spec.answer_strict))
        return st.StructuralTag(format=st.OrFormat(elements=[calls, answer]))
    if spec.mode == "auto":
        calls = st.SequenceFormat(elements=[st.AnyTextFormat(excludes=[TOOL_CALL_OPEN]), calls])
    return st.StructuralTag(format=calls)


def _arguments_grammar(function: FunctionSpec) -> str:
    return _json_grammar(function.schema, f"the parameters schema of function {function.name!r}",
                         strict=function.strict)


def _json_grammar(schema: Any, what: str, any_whitespace: bool = False,
                  strict: bool = False) -> str:
    """EBNF text for JSON valid against ``schema`` (compact unless ``any_whitespace``), its
    numbers bounded (``agentd.structured.repetition``) and its dates and times RFC 3339's
    (``agentd.structured.formats``). A schema over the size limits, or with a part that has no
    finite instance, or (``strict``) with a keyword the grammar cannot enforce, is a
    GrammarError before xgrammar sees it."""
    import xgrammar as xgr

    check_limits(schema, what)
    problem = no_finite_instance(schema) or check_enforced(schema, strict)
    if problem is not None:
        raise GrammarError(f"{what}: {problem}")
    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(tighten_formats(schema)), any_whitespace=any_whitespace,
            separators=None if any_whitespace else JSON_SEPARATORS, strict_mode=True)
    except Exception as exc:
        raise GrammarError(f"{what} cannot be compiled: {_reason(exc)}") from exc
    return bound_numbers(str(grammar))


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal (xgrammar reads JSON-style escapes)."""
    return json.dumps(text, ensure_ascii=True)


def _reason(exc: BaseException) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else
                           type(exc).__name__)
