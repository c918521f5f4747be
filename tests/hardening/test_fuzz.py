"""Fuzzing the daemon through its own OpenAPI schema with schemathesis: valid-by-schema and
invalid-by-schema requests to every operation (``/admin/shutdown`` aside) on a loopback server,
a bounded ~100 examples in all, derandomized so CI is reproducible. No reply may be a 5xx, every
4xx carries its route's error shape (OpenAI's envelope; Anthropic's on ``/v1/messages``), and the
pool is sound and idle afterwards (stored responses forgotten first: their tails are held).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.llm_engine import LLMEngine
from agentd.server.app import create_app

FUZZ_MAX_MODEL_LEN = 256  # bounds the longest generation a fuzzed max_tokens can ask for
# examples per (operation, mode); operations not listed get DEFAULT_EXAMPLES
EXAMPLES = {("POST", "/v1/chat/completions"): (25, 15), ("POST", "/v1/completions"): (15, 10),
            ("POST", "/v1/pins"): (8, 6)}
DEFAULT_EXAMPLES = (3, 2)
SKIP = {("POST", "/admin/shutdown")}


@pytest.fixture(scope="module")
def fuzz_server(tiny, serve) -> Iterator[tuple[str, Any]]:
    """(URL, ServerState) of a loopback daemon over a small-context engine."""
    config, shared = tiny
    small = EngineConfig(model=config.model, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                         max_model_len=FUZZ_MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine(small, loaded=shared.engine.loaded))
    engine.start()
    try:
        app = create_app(small, engine=engine)
        with serve(app) as url:
            yield url, app.state.agentd
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def fuzz_url(fuzz_server) -> str:
    return fuzz_server[0]


def test_schemathesis_finds_no_server_error(fuzz_server, idle) -> None:
    fuzz_url, server = fuzz_server
    spec = httpx.get(f"{fuzz_url}/docs/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    seen: dict[tuple[str, str], dict[int, int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        key = (operation.method.upper(), operation.path)
        if key in SKIP:
            continue
        counts = seen.setdefault(key, {})
        for mode, num_examples in zip((GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
                                      EXAMPLES.get(key, DEFAULT_EXAMPLES), strict=True):
            _fuzz(operation, mode, num_examples, fuzz_url, counts)
    assert ("POST", "/v1/chat/completions") in seen and ("POST", "/v1/pins") in seen
    assert any(200 in c or 201 in c for c in seen.values())  # some fuzzed requests were served
    for pin in httpx.get(f"{fuzz_url}/v1/pins", timeout=30).json()["data"]:
        httpx.delete(f"{fuzz_url}/v1/pins/{pin['name']}", timeout=30)
    server.responses.clear()  # stored responses hold their conversations' last blocks
    idle(lambda path: httpx.get(f"{fuzz_url}{path}", timeout=30), num_pinned_ok=False)
    print({f"{m} {p}": dict(sorted(c.items())) for (m, p), c in seen.items()})


def _fuzz(operation, mode: GenerationMode, num_examples: int, url: str,
          counts: dict[int, int]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call(base_url=url, timeout=60)
        status = response.status_code
        counts[status] = counts.get(status, 0) + 1
        assert status < 500, f"{case.method} {case.path}: {status} {response.content[:500]!r}"
        if status >= 400 and case.path.startswith("/v1/messages"):
            body = json.loads(response.content)
            assert body["type"] == "error" and {"type", "message"} == set(body["error"]), body
        elif status >= 400:
            body = json.loads(response.content)
            assert set(body) == {"error"} and {"message", "type", "param", "code"} == \
                set(body["error"]), body

    try:
        check()
    except Unsatisfiable:  # an operation without parameters has no invalid-by-schema request
        assert mode is GenerationMode.NEGATIVE and not operation.body, operation.label


# --- requests valid in shape, with every sampling knob drawn from its whole type -------------
# The schema leaves roles and contents free, so schemathesis seldom builds a chat request the
# engine runs; these do, with extreme numbers where the engine does arithmetic.
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
TINY_FLOATS = [0.0, 5e-324, 1e-45, 1e-30, 1e-6, 1e-5, 1.0, 2.0]
NUMBER = st.one_of(st.sampled_from(TINY_FLOATS), st.floats(min_value=0, max_value=2),
                   st.floats(allow_nan=False, allow_infinity=False), st.none())
SEED = st.one_of(st.sampled_from([2**64, 2**64 - 1, -(2**63), -(2**63) - 1, 0]), st.integers(),
                 st.none())
INTEGER = st.one_of(st.none(), st.integers(), st.integers(-3, 300), st.just(10**12))
MAX_TOKENS = st.one_of(st.none(), st.integers(1, 24), st.integers())
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    "content": TEXT, "tool_call_id": st.just("call_1")}), min_size=1, max_size=4)
TOP_P = st.one_of(st.sampled_from([5e-324, 1e-30, 0.5, 1.0]), NUMBER,
                  st.floats(min_value=0, max_value=1, exclude_min=True))
KNOBS = {"temperature": NUMBER, "seed": SEED, "top_p": TOP_P}
CHAT_BODIES = st.fixed_dictionaries({"messages": MESSAGES, **KNOBS}, optional={
    "top_k": INTEGER, "max_tokens": MAX_TOKENS, "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER, "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stop": st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=5)),
    "cache_salt": st.one_of(st.none(), TEXT)})
COMPLETION_BODIES = st.fixed_dictionaries({"prompt": st.one_of(
    TEXT, st.lists(st.integers(-5, 50_000), min_size=1, max_size=30)), **KNOBS}, optional={
    "top_k": INTEGER, "max_tokens": MAX_TOKENS, "echo": st.booleans(), "stream": st.booleans()})


@pytest.mark.parametrize(("path", "bodies", "num_examples"), [
    ("/v1/chat/completions", CHAT_BODIES, 40), ("/v1/completions", COMPLETION_BODIES, 25)])
def test_runnable_requests_with_extreme_knobs_never_fail_the_server(fuzz_url: str, path: str,
                                                                    bodies, num_examples: int,
                                                                    idle) -> None:
    statuses: dict[int, int] = {}

    @given(body=bodies)
    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(body) -> None:
        response = httpx.post(f"{fuzz_url}{path}", json=body, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code in (200, 400), response.text[:500]
        if body.get("stream") and response.status_code == 200:
            assert response.text.endswith("data: [DONE]\n\n")
            assert '"server_error"' not in response.text, response.text[-500:]

    check()
    assert statuses.get(200, 0) >= num_examples // 8, statuses  # the engine really ran some
    idle(lambda p: httpx.get(f"{fuzz_url}{p}", timeout=30), num_pinned_ok=False)
