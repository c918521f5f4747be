"""Isolation: cached context never crosses a cache salt. ``cache_salt`` (vLLM semantics: mixed
into the first block's hash) and, with several API keys, a per-key salt by default, so tenants
never share blocks: ``cached_tokens`` is 0 across salts and > 0 within one. ``--shared-cache``
(and a single key) keep one shared cache, where pins hit for everyone; with per-key caches a pin
hits only for the tenant that made it (test_tenants.py has the rest of the pin rules).

And, in the spirit of llama.cpp #27148 (an unrelated conversation restored into a fresh slot
under concurrent load): 15 multi-turn conversations over a pool far too small for all of them —
so blocks are evicted, shared and requests preempted — run concurrently in random interleavings
give exactly the replies each gives when run alone.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from importlib import resources
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.llm_engine import LLMEngine
from agentd.server.app import ServerSettings, create_app
from agentd.server.auth import tenant_of

LOCAL = "http://127.0.0.1"  # a Host header the daemon answers to (testserver.local is not)

KEYS = ("sk-tenant-a", "sk-tenant-b")
WORKLOADS = ("coding_agent", "support_agent", "research_agent")


def workload(name: str) -> dict[str, Any]:
    return json.loads(resources.files("agentd.workloads").joinpath(f"{name}.json").read_text())


def system_prompt(tag: str) -> str:
    """A long system prompt unique to ``tag``, so each test starts from a cold cache."""
    return f"[{tag}] " + workload("research_agent")["system"][:1500]


def cached(client: TestClient, system: str, key: str | None = None,
           salt: str | None = None, **fields: Any) -> int:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "What can you do?"}],
                            "max_tokens": 1, "temperature": 0, **fields}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def clients(tiny, app_clients) -> Iterator[dict[str, TestClient]]:
    """Apps over one engine (so one pool): open, one key, two keys, two keys sharing."""
    with app_clients(tiny, {"open": ServerSettings(),
                            "one key": ServerSettings(api_keys=KEYS[:1]),
                            "two keys": ServerSettings(api_keys=KEYS),
                            "shared": ServerSettings(api_keys=KEYS, shared_cache=True)}) as clients:
        yield clients


def test_explicit_cache_salt_hits_only_within_the_salt(clients, idle) -> None:
    client, system = clients["open"], system_prompt("explicit-salt")
    assert cached(client, system, salt="a") == 0
    assert cached(client, system, salt="a") > 0
    assert cached(client, system, salt="b") == 0
    assert cached(client, system) == 0  # unsalted never sees salted blocks ...
    assert cached(client, system) > 0
    assert cached(client, system, salt="c") == 0  # ... nor salted unsalted ones
    assert cached(client, system, salt="b") > 0
    idle(client.get, num_pinned_ok=False)


def test_each_key_gets_its_own_cache_by_default(clients, idle) -> None:
    client, system = clients["two keys"], system_prompt("per-key")
    a, b = KEYS
    assert cached(client, system, a) == 0
    assert cached(client, system, a) > 0
    assert cached(client, system, b) == 0  # tenant b never gets tenant a's blocks
    assert cached(client, system, b) > 0
    # a client salt narrows a tenant's cache; it never reaches another tenant's
    assert cached(client, system, a, salt="x") == 0
    assert cached(client, system, b, salt="x") == 0
    assert cached(client, system, a, salt="x") > 0
    # nor do tenant blocks leak to an unkeyed server over the same pool, or back
    assert cached(clients["open"], system) == 0
    assert cached(clients["open"], system, salt=f"tenant:{a}") == 0
    idle(clients["open"].get, num_pinned_ok=False)  # the same engine; /admin is the operator's


def test_shared_cache_and_a_single_key_share_blocks(clients) -> None:
    system = system_prompt("shared")
    a, b = KEYS
    assert cached(clients["shared"], system, a) == 0
    assert cached(clients["shared"], system, b) > 0
    assert cached(clients["one key"], system, a) > 0  # one key: the shared cache too
    assert cached(clients["open"], system) > 0


def test_pins_hit_in_the_shared_cache_and_only_for_their_tenant(clients, idle) -> None:
    """The documented rule: a pin made in the shared cache (no key, one key, ``--shared-cache``)
    serves it; with per-key caches a pin is hashed with its tenant's salt and serves that tenant
    alone."""
    a, b = KEYS
    shared, tenant = system_prompt("pinned-shared"), system_prompt("pinned-tenant")
    created = clients["open"].post("/v1/pins", json={"name": "iso", "system": shared})
    assert created.status_code == 201, created.text
    mine = clients["two keys"].post("/v1/pins", json={"name": "iso", "system": tenant},
                                    headers={"Authorization": f"Bearer {a}"})
    assert mine.status_code == 201, mine.text
    try:
        num_tokens = created.json()["num_tokens"]
        assert cached(clients["open"], shared) >= num_tokens
        assert cached(clients["one key"], shared, a) >= num_tokens
        assert cached(clients["shared"], shared, b) >= num_tokens
        assert cached(clients["two keys"], shared, a) == 0
        assert cached(clients["two keys"], tenant, a) >= mine.json()["num_tokens"]
        assert cached(clients["two keys"], tenant, b) == 0
        assert cached(clients["open"], tenant) == 0
    finally:
        assert clients["open"].delete("/v1/pins/iso").status_code == 200
        assert clients["two keys"].delete("/v1/pins/iso", headers={
            "Authorization": f"Bearer {a}"}).status_code == 200
    idle(clients["open"].get, num_pinned_ok=False)


def test_a_retained_prefix_is_its_tenants_alone(clients, tiny, idle) -> None:
    """A prefix kept by cache control is hashed with its tenant's salt, like its requests: it
    serves that tenant alone, and the operator's stats name its owner."""
    a, b = KEYS
    system = system_prompt("retained-tenant")
    try:
        assert cached(clients["two keys"], system, a, prompt_cache_retention="24h") == 0
        assert cached(clients["two keys"], system, b) == 0
        assert cached(clients["open"], system) == 0
        assert cached(clients["two keys"], system, a) > 0
        [entry] = clients["open"].get("/v1/stats").json()["retained"]
        assert entry["owner"] == tenant_of(a) and entry["hits"] == 1
    finally:  # retained prefixes hold their blocks for 24 h: let this one decay now
        _, engine = tiny
        asyncio.run(engine.call(lambda e: [e.pins.registry.release_retained(p.key)
                                           for p in e.pins.registry.retained]))
    idle(clients["open"].get, num_pinned_ok=False)


# --- interleaved conversations vs the same conversations alone --------------------------------
NUM_TURNS = 3
MAX_TOKENS = 8
# 48 blocks of 16 tokens (8 KiB each for the tiny llama): room for the longest conversation alone
# (642 tokens, 41 blocks) but never for two (every prompt is over 450 tokens, 29 blocks). With a
# 64-token budget prompts are prefilled in chunks, so a second request is admitted while the
# first still runs and must grow into blocks that are not there: any overlap preempts.
SMALL_POOL_BYTES = 48 * 8192
SEEDS = (1,)  # one random interleaving in CI (each ~14 s of its time); -m full's test runs more
SMALL_BUDGET = 64


def conversations() -> list[dict[str, Any]]:
    """15 conversations: 5 per workload, each with its own user turns, half of them salted."""
    convs = []
    for w, name in enumerate(WORKLOADS):
        spec = workload(name)
        for c in range(5):
            turns = spec["turns"][c * NUM_TURNS:(c + 1) * NUM_TURNS]
            salt = f"tenant-{c % 3}" if (w + c) % 2 else None
            convs.append({"system": spec["system"][:2000], "turns": turns, "salt": salt})
    return convs


async def converse(http: httpx.AsyncClient, conv: dict[str, Any], rng: random.Random | None,
                   ) -> list[str]:
    """Run one conversation turn by turn, feeding the model's replies back; with ``rng``, sleep
    a random while before each turn and stream some turns."""
    messages = [{"role": "system", "content": conv["system"]}]
    replies = []
    for turn in conv["turns"]:
        messages.append({"role": "user", "content": turn})
        body: dict[str, Any] = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        if conv["salt"] is not None:
            body["cache_salt"] = conv["salt"]
        stream = False
        if rng is not None:
            await asyncio.sleep(rng.random() * 0.3)
            stream = rng.random() < 0.5
        reply = await (_stream_reply(http, body) if stream else _reply(http, body))
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies


async def _reply(http: httpx.AsyncClient, body: dict[str, Any]) -> str:
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def _stream_reply(http: httpx.AsyncClient, body: dict[str, Any]) -> str:
    pieces = []
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    pieces.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(pieces)


@pytest.fixture(scope="module")
def small_pool_url(tiny, serve) -> Iterator[str]:
    config, shared = tiny
    small = EngineConfig(model=config.model, kv_cache_memory_bytes=SMALL_POOL_BYTES,
                         max_num_batched_tokens=SMALL_BUDGET)
    engine = AsyncEngine(LLMEngine(small, loaded=shared.engine.loaded))
    assert engine.engine.num_blocks == 48
    engine.start()
    try:
        with serve(create_app(small, engine=engine)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.mark.parametrize("seeds", [SEEDS, pytest.param((2, 3, 4), marks=pytest.mark.full)])
def test_interleaved_conversations_equal_the_same_conversations_alone(small_pool_url: str,
                                                                      idle, seeds) -> None:
    convs = conversations()
    assert len(convs) >= 12

    async def alone() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=small_pool_url, timeout=300) as http:
            return [await converse(http, conv, None) for conv in convs]

    async def interleaved(seed: int) -> list[list[str]]:
        rng = random.Random(seed)
        order = list(range(len(convs)))
        rng.shuffle(order)
        async with httpx.AsyncClient(base_url=small_pool_url, timeout=300) as http:
            tasks = {i: asyncio.create_task(converse(http, convs[i], random.Random(rng.random())))
                     for i in order}
            return [await tasks[i] for i in range(len(convs))]

    def stats() -> dict[str, Any]:
        return httpx.get(f"{small_pool_url}/v1/stats", timeout=30).json()

    expected = asyncio.run(alone())
    before = stats()
    for seed in seeds:
        assert asyncio.run(interleaved(seed)) == expected
    after = stats()
    assert len({tuple(r) for r in expected}) == len(convs)  # they really are different
    assert after["num_preemptions"] > before["num_preemptions"]  # the pool was under pressure
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]  # and the cache was used
    idle(lambda path: httpx.get(f"{small_pool_url}{path}", timeout=30), num_pinned_ok=False)
