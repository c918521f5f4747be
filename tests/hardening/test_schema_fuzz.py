"""Random schemas (recursive, huge enums, deep nesting, keywords the grammar cannot enforce,
strict or not) through the schema checks, the grammar compiler and a short generation, in a
child process under a memory cap: every one ends in a refusal (GrammarError, the server's
400) or a generation that finished, and a reply that completed validates against its schema
wherever the grammar enforces all of it. Derandomized, so CI is reproducible.

The child (the offline ``LLM`` on the tiny Llama, the real SmolLM2 tokenizer) reads one case a
line and answers one line; it dying, or not answering within ``CASE_TIMEOUT_S`` (a hang guard:
cases take well under a second), fails the test with the case.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

MAX_ADDRESS_SPACE_BYTES = 3 * 2**30  # the child peaks near 1.2 GiB of it
CASE_TIMEOUT_S = 120
WORKER = r"""
import json, sys
import jsonschema
from agentd import LLM, SamplingParams
from agentd.structured.enforced import unenforced
from agentd.structured.params import StructuredOutputsParams

llm = LLM(sys.argv[1], device="cpu", kv_cache_memory_bytes=16 * 2**20, max_model_len=512)
prompt = llm.tokenizer("Reply in JSON:").input_ids
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    try:
        params = StructuredOutputsParams(**json.loads(line))
        sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=0,
                                  structured_outputs=params)
        out = llm.generate([prompt], sampling)[0]
    except ValueError as exc:  # GrammarError: the server answers it with a 400
        print(json.dumps({"refused": str(exc)}), flush=True)
        continue
    valid = None
    if out.finish_reason == "stop" and params.json is not None and not unenforced(params.json):
        try:
            jsonschema.validate(json.loads(out.text), params.json)
            valid = True
        except (ValueError, jsonschema.ValidationError) as exc:
            valid = str(exc)[:500]
    print(json.dumps({"finish": out.finish_reason, "text": out.text, "valid": valid}),
          flush=True)
"""


class Worker:
    def __init__(self, model_dir: str) -> None:
        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (MAX_ADDRESS_SPACE_BYTES,) * 2)

        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, model_dir], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self.answer(600) == {"ready": True}

    def answer(self, timeout_s: float = CASE_TIMEOUT_S) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            assert self.process.stderr is not None
            pytest.fail(f"the worker died or hung: {self.process.stderr.read()[-3000:]}")
        return json.loads(line)

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(case) + "\n")
        self.process.stdin.flush()
        return self.answer()


@pytest.fixture(scope="module")
def worker(tiny_model_factory) -> Iterator[Worker]:
    started = Worker(str(tiny_model_factory("llama")))
    yield started
    started.process.kill()
    started.process.wait()


NAMES = st.sampled_from(["a", "b", "next", "id", "é"])
EXTRAS = st.sampled_from([
    {}, {}, {}, {"not": {"type": "null"}}, {"uniqueItems": True}, {"contains": {"const": 1}},
    {"if": {"type": "object"}, "then": {"required": ["a"]}}, {"dependentRequired": {"a": ["b"]}},
    {"format": "email"}, {"format": "bogus"}, {"multipleOf": 2}, {"minItems": 1},
    {"minProperties": 1}, {"additionalProperties": False}, {"additionalProperties": True},
    {"patternProperties": {"^x": {"type": "integer"}}}, {"propertyNames": {"maxLength": 3}},
    {"$ref": "#"}, {"minimum": 1}])
SCALARS = st.one_of(
    st.builds(lambda kind: {"type": kind},
              st.sampled_from(["string", "integer", "number", "boolean", "null"])),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda low: {"type": "integer", "minimum": low, "maximum": low + 9},
              st.integers(-5, 5)),
    st.builds(lambda values: {"enum": values}, st.lists(
        st.one_of(st.integers(-3, 3), st.text(max_size=4)), min_size=1, max_size=5,
        unique_by=json.dumps)),
    st.builds(lambda n: {"enum": [f"value {i}" for i in range(n)]}, st.integers(200, 3000)),
    st.builds(lambda value: {"const": value}, st.one_of(st.integers(), st.text(max_size=5))),
    st.sampled_from([{"$ref": "#"}, {"$ref": "#/$defs/d"}, {"$ref": "#/$defs/none"}, True]))


def _object(properties: dict[str, Any], every: bool, extra: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if every else list(properties)[:1], **extra}


def _compound(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.builds(_object, st.dictionaries(NAMES, children, max_size=3), st.booleans(), EXTRAS),
        st.builds(lambda items, n, extra: {"type": "array", "items": items, "minItems": n,
                                           **extra}, children, st.integers(0, 2), EXTRAS),
        st.builds(lambda kind, branches: {kind: branches},
                  st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(children, min_size=1, max_size=3)))


SCHEMAS = st.recursive(SCALARS, _compound, max_leaves=10)


def _nested(depth: int, kind: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = ({"type": "array", "items": schema} if kind == "array" else
                  {"type": "object", "properties": {"a": schema}, "required": ["a"]})
    return schema


def _rooted(body: Any, definition: Any) -> Any:
    return {**body, "$defs": {"d": definition}} if isinstance(body, dict) else body


CASES = st.one_of(
    st.builds(lambda body, definition, strict: {"json": _rooted(body, definition),
                                                "strict": strict},
              SCHEMAS, SCHEMAS, st.booleans()),
    st.builds(lambda depth, kind: {"json": _nested(depth, kind)}, st.integers(40, 120),
              st.sampled_from(["array", "object"])))

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
# a finite schema whose one instance is 2^20 levels of pairs: forced text without practical end
PAIRS = {"$defs": {f"p{i}": {"type": "object", "properties": {
    "l": {"$ref": f"#/$defs/p{i + 1}"}, "r": {"$ref": f"#/$defs/p{i + 1}"}},
    "required": ["l", "r"]} for i in range(20)} | {"p20": {"const": 0}}, "$ref": "#/$defs/p0"}


@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=CASES)
@example(case={"json": {"$defs": {"n": NODE}, "$ref": "#/$defs/n"}})
@example(case={"json": {"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, "strict": True})
@example(case={"grammar": 'root ::= "a" root'})  # EBNF that forces text without end
@example(case={"json": PAIRS})
@example(case={"json": {"enum": [f"value {i}" for i in range(5000)]}})
@example(case={"json": _nested(200, "object")})
def test_every_schema_ends_in_a_refusal_or_a_reply(worker: Worker, case: dict) -> None:
    answer = worker.run(case)
    if "refused" in answer:
        assert not any(word in answer["refused"] for word in ("bad_alloc", "MemoryError")), \
            answer
        return
    # "abort": the engine's grammar dead end, a request that ends with an error (a 500
    # grammar_dead_end on the wire) while the engine goes on; xgrammar's masks for an enum of
    # astral-plane characters (U+40000) let through a token that leads nowhere
    assert answer["finish"] in ("stop", "length", "abort"), answer
    assert answer["valid"] in (None, True), (case, answer)
