"""Choose the grammar engine by measurement: xgrammar vs llguidance on this machine.

For each packaged workload's tools it prints the time to compile the tool-call grammar
(``tool_choice: "required"`` and ``"auto"``) and, at batch 1, 8 and 32, the time per decoding
step spent on constraints: filling every row's token bitmask, applying the masks to a
``[batch, vocab]`` float32 logits tensor, and advancing every matcher by its token. Each matcher
follows a valid call of a different tool, token by token, as a constrained request would.

    python benchmarks/grammar_engines.py            # both engines (pip install llguidance)

This is a measurement, not a test; it needs the default model's tokenizer (`.ci/setup`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from importlib import resources
from typing import Any

import torch

WORKLOADS = ("coding_agent", "support_agent", "research_agent")
OPEN = '<tool_call>\n{{"name": "{name}", "arguments": '
CLOSE = "}\n</tool_call>"


def cpu_banner() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines()
                  if line.startswith("Model name")), platform.processor())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f} " in flags]
    return (f"CPU: {model} ({os.cpu_count()} cores; {', '.join(isa)}); torch "
            f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")


def load_tools(name: str) -> list[dict[str, Any]]:
    text = resources.files("agentd.workloads").joinpath(f"{name}.json").read_text()
    return [tool["function"] for tool in json.loads(text)["tools"]]


def sample_value(schema: dict[str, Any]) -> Any:
    """A small value valid against ``schema`` (the subset the workloads use)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type", "string")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties", {})
        return {key: sample_value(props[key]) for key in schema.get("required", [])}
    return {"string": "src/app.py", "integer": schema.get("minimum", 3),
            "number": schema.get("minimum", 1.5), "boolean": True, "array": [],
            "null": None}[kind]


def call_text(tool: dict[str, Any]) -> str:
    args = json.dumps(sample_value(tool["parameters"]), separators=(", ", ": "))
    return OPEN.format(name=tool["name"]) + args + CLOSE


# --- xgrammar --------------------------------------------------------------------------------

class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_ids)
        self.vocab_size = vocab_size

    def _tags(self, tools: list[dict[str, Any]]) -> list[Any]:
        from xgrammar import structural_tag as st

        tags = []
        for tool in tools:
            body = self.xgr.Grammar.from_json_schema(json.dumps(tool["parameters"]),
                                                     any_whitespace=False,
                                                     separators=(", ", ": "))
            tags.append(st.TagFormat(begin=OPEN.format(name=tool["name"]),
                                     content=st.GrammarFormat(grammar=str(body)), end=CLOSE))
        return tags

    def compile(self, tools: list[dict[str, Any]], mode: str) -> Any:
        from xgrammar import structural_tag as st

        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        calls = st.TagsWithSeparatorFormat(tags=self._tags(tools), separator="\n",
                                           at_least_one=mode == "required")
        if mode == "auto":
            calls = st.SequenceFormat(elements=[st.AnyTextFormat(excludes=["<tool_call>"]),
                                                calls])
        return compiler.compile_structural_tag(st.StructuralTag(format=calls))

    def matcher(self, grammar: Any) -> Any:
        return self.xgr.GrammarMatcher(grammar)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def step(self, matchers: list[Any], tokens: list[int], bitmask: torch.Tensor,
             logits: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)
        for matcher, token in zip(matchers, tokens, strict=True):
            assert matcher.accept_token(token)


# --- llguidance ------------------------------------------------------------------------------

class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llt = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, tools: list[dict[str, Any]], mode: str) -> Any:
        rules, alternatives = [], []
        for i, tool in enumerate(tools):
            schema = dict(tool["parameters"])
            schema["x-guidance"] = {"whitespace_flexible": False, "key_separator": ": ",
                                    "item_separator": ", "}
            rules.append(f"args{i}: %json {json.dumps(schema)}")
            alternatives.append(f'{json.dumps(OPEN.format(name=tool["name"]))} args{i} '
                                f'{json.dumps(CLOSE)}')
        calls = 'calls: call ("\\n" call)*'
        start = "start: calls" if mode == "required" else 'start: TEXT? calls?\nTEXT: /(.|\\n)+/'
        grammar = "\n".join([start, calls, "call: " + " | ".join(alternatives), *rules])
        spec = self.llg.LLMatcher.grammar_from_lark(grammar)
        matcher = self.llg.LLMatcher(self.tokenizer, spec, log_level=1)
        bitmask = self.bitmask(1)
        self.llt.fill_next_token_bitmask(matcher, bitmask, 0)  # llguidance compiles lazily
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return spec

    def matcher(self, grammar: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, grammar, log_level=1)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(batch, self.vocab_size)

    def step(self, matchers: list[Any], tokens: list[int], bitmask: torch.Tensor,
             logits: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            self.llt.fill_next_token_bitmask(matcher, bitmask, i)
        self.llt.apply_token_bitmask_inplace(logits, bitmask)
        for matcher, token in zip(matchers, tokens, strict=True):
            assert matcher.consume_token(token)


def time_compile(engine: Any, tools: list[dict[str, Any]], mode: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        engine.compile(tools, mode)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_steps(engine: Any, tokenizer: Any, tools: list[dict[str, Any]], batch: int) -> float:
    """Median seconds per step of ``batch`` matchers walking valid calls together."""
    grammar = engine.compile(tools, "required")
    sequences = [tokenizer(call_text(tools[i % len(tools)]), add_special_tokens=False).input_ids
                 for i in range(batch)]
    length = min(len(s) for s in sequences)
    matchers = [engine.matcher(grammar) for _ in range(batch)]
    bitmask = engine.bitmask(batch)
    logits = torch.randn(batch, engine.vocab_size)
    times = []
    for position in range(length):
        start = time.perf_counter()
        engine.step(matchers, [s[position] for s in sequences], bitmask, logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="compiles per figure (median)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from agentd.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    print(cpu_banner())
    engines = []
    for cls in (XGrammar, LLGuidance):
        try:
            start = time.perf_counter()
            engines.append(cls(tokenizer, 49152, [tokenizer.eos_token_id]))
            print(f"{cls.name}: tokenizer info built in {time.perf_counter() - start:.3f} s")
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
    print("\ncompile, median of", args.repeat, "(s)")
    print(f"{'workload':<16} {'tools':>5} " + " ".join(
        f"{e.name + ' ' + m:>22}" for e in engines for m in ("required", "auto")))
    for name in WORKLOADS:
        tools = load_tools(name)
        cells = [time_compile(e, tools, m, args.repeat) for e in engines
                 for m in ("required", "auto")]
        print(f"{name:<16} {len(tools):>5} " + " ".join(f"{c:>22.4f}" for c in cells))
    print("\nconstraint work per decoding step (ms): fill masks + apply + advance, median")
    print(f"{'batch':>5} " + " ".join(f"{e.name:>12}" for e in engines))
    tools = load_tools("coding_agent")
    for batch in (1, 8, 32):
        cells = [time_steps(e, tokenizer, tools, batch) * 1e3 for e in engines]
        print(f"{batch:>5} " + " ".join(f"{c:>12.3f}" for c in cells))


if __name__ == "__main__":
    main()
