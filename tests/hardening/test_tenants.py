"""Tenants and pins: with several ``--api-key`` keys a pin belongs to the key that made it — its
name space (another key neither lists, reads, deletes nor collides with it) and its cache salt
(only that key's requests hit it) — unless ``--shared-cache``; an ``--admin-key`` lists and
deletes every tenant's pins (``?owner=``), and its own are server-wide. Per-pin stats and
metrics keep two tenants' pins of one name apart. A stored response (Responses API) is the key's
that made it, with or without ``--shared-cache``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from agentd.server.app import ServerSettings, create_app
from agentd.server.auth import tenant_of

K1, K2, ADMIN = "sk-tenant-one", "sk-tenant-two", "sk-operator"
SYSTEMS = {K1: "You are tenant one's research agent. Cite every source. " * 12,
           K2: "You are tenant two's support agent. Be kind and brief. " * 12}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def apps(tiny, app_clients) -> Iterator[dict[str, TestClient]]:
    with app_clients(tiny, {
            "tenants": ServerSettings(api_keys=(K1, K2), admin_keys=(ADMIN,)),
            "shared": ServerSettings(api_keys=(K1, K2), shared_cache=True)}) as clients:
        yield clients


def cached(client: TestClient, key: str, system: str) -> int:
    reply = client.post("/v1/chat/completions", headers=auth(key), json={
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def names(client: TestClient, key: str) -> list[tuple[Any, str]]:
    listed = client.get("/v1/pins", headers=auth(key))
    assert listed.status_code == 200, listed.text
    return sorted((p["owner"] or "", p["name"]) for p in listed.json()["data"])


def test_a_pin_belongs_to_the_key_that_made_it(apps, openai_error, idle) -> None:
    client = apps["tenants"]
    one, two = tenant_of(K1), tenant_of(K2)
    made = client.post("/v1/pins", headers=auth(K1), json={"name": "agent", "system": SYSTEMS[K1]})
    assert made.status_code == 201, made.text
    assert made.json()["owner"] == one
    assert names(client, K1) == [(one, "agent")] and names(client, K2) == []
    openai_error(client.get("/v1/pins/agent", headers=auth(K2)), 404)
    openai_error(client.delete("/v1/pins/agent", headers=auth(K2)), 404)
    refused = client.delete(f"/v1/pins/agent?owner={one}", headers=auth(K2))
    assert openai_error(refused, 403)["param"] == "owner"
    assert names(client, K1) == [(one, "agent")]  # untouched by all that
    theirs = client.post("/v1/pins", headers=auth(K2), json={"name": "agent",
                                                            "system": SYSTEMS[K2]})
    assert theirs.status_code == 201, theirs.text  # the same name in another name space
    # each pin serves its own tenant only
    assert cached(client, K1, SYSTEMS[K1]) >= made.json()["num_tokens"]
    assert cached(client, K2, SYSTEMS[K2]) >= theirs.json()["num_tokens"]
    assert cached(client, K2, SYSTEMS[K1]) == 0
    assert cached(client, ADMIN, SYSTEMS[K1]) == 0  # the operator's requests: the shared cache
    # the operator sees both, with their owners, and can delete either
    assert names(client, ADMIN) == sorted([(one, "agent"), (two, "agent")])
    openai_error(client.get("/v1/pins/agent", headers=auth(ADMIN)), 404)  # no server-wide one
    assert client.get(f"/v1/pins/agent?owner={two}", headers=auth(ADMIN)).json()["owner"] == two
    stats = client.get("/v1/stats", headers=auth(ADMIN)).json()
    assert sorted((p["owner"], p["name"]) for p in stats["pins"]) == sorted(
        [(one, "agent"), (two, "agent")])
    metrics = client.get("/metrics", headers=auth(ADMIN)).text
    for owner in (one, two):
        assert re.search(rf'agentd:pin_blocks{{[^}}]*owner="{owner}",pin="agent"}}', metrics)
    assert client.delete(f"/v1/pins/agent?owner={one}", headers=auth(ADMIN)).status_code == 200
    assert names(client, K1) == [] and names(client, K2) == [(two, "agent")]
    assert client.delete("/v1/pins/agent", headers=auth(K2)).status_code == 200
    idle(lambda path: client.get(path, headers=auth(ADMIN)), num_pinned_ok=False)


def test_an_admin_keys_pins_are_server_wide(apps, idle) -> None:
    client = apps["tenants"]
    made = client.post("/v1/pins", headers=auth(ADMIN), json={"name": "house",
                                                               "system": SYSTEMS[K2]})
    assert made.status_code == 201, made.text
    assert made.json()["owner"] is None
    assert names(client, K1) == [] and names(client, ADMIN) == [("", "house")]
    assert cached(client, ADMIN, SYSTEMS[K2]) >= made.json()["num_tokens"]
    assert client.delete("/v1/pins/house", headers=auth(ADMIN)).status_code == 200
    idle(lambda path: client.get(path, headers=auth(ADMIN)), num_pinned_ok=False)


def test_with_a_shared_cache_every_key_shares_the_pins(apps, idle) -> None:
    client = apps["shared"]
    made = client.post("/v1/pins", headers=auth(K1), json={"name": "team", "system": SYSTEMS[K1]})
    assert made.status_code == 201, made.text
    assert names(client, K2) == [("", "team")]
    assert cached(client, K2, SYSTEMS[K1]) >= made.json()["num_tokens"]
    assert client.delete("/v1/pins/team", headers=auth(K2)).status_code == 200
    assert names(client, K1) == []
    idle(lambda path: client.get(path, headers=auth(K1)), num_pinned_ok=False)


@pytest.mark.parametrize("app", ["tenants", "shared"])
def test_a_stored_response_is_its_keys_alone(apps, app: str, openai_error, idle) -> None:
    """Per API key, also with --shared-cache (which shares prefixes, not conversations): another
    key can neither read, continue nor delete it; its own key still can, afterwards."""
    client = apps[app]
    made = client.post("/v1/responses", headers=auth(K1), json={
        "input": "Remember the word teal.", "max_output_tokens": 2})
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    for other in (K2, ADMIN) if app == "tenants" else (K2,):
        got = client.get(f"/v1/responses/{response_id}", headers=auth(other))
        assert openai_error(got, 404)["param"] == "response_id"
        continued = client.post("/v1/responses", headers=auth(other), json={
            "input": "Which word?", "previous_response_id": response_id, "max_output_tokens": 2})
        assert openai_error(continued, 404)["param"] == "previous_response_id"
        deleted = client.delete(f"/v1/responses/{response_id}", headers=auth(other))
        assert openai_error(deleted, 404)["code"] == "response_not_found"
    assert client.get(f"/v1/responses/{response_id}", headers=auth(K1)).json()["id"] == response_id
    continued = client.post("/v1/responses", headers=auth(K1), json={
        "input": "Which word?", "previous_response_id": response_id, "max_output_tokens": 2,
        "store": False})
    assert continued.status_code == 200, continued.text
    assert client.delete(f"/v1/responses/{response_id}", headers=auth(K1)).status_code == 200
    openai_error(client.get(f"/v1/responses/{response_id}", headers=auth(K1)), 404)
    idle(lambda path: client.get(path, headers=auth(ADMIN if app == "tenants" else K1)),
         num_pinned_ok=False)


def test_an_admin_unpins_a_tenants_pin_from_the_cli(tiny, serve) -> None:
    from click.testing import CliRunner

    from agentd.cli import main

    config, engine = tiny
    settings = ServerSettings(api_keys=(K1, K2), admin_keys=(ADMIN,))
    with serve(create_app(config, engine=engine, settings=settings)) as url:
        made = httpx.post(f"{url}/v1/pins", headers=auth(K1), timeout=60,
                          json={"name": "agent", "system": SYSTEMS[K1]})
        assert made.status_code == 201, made.text
        runner = CliRunner()
        as_tenant = runner.invoke(main, ["unpin", "agent", "--owner", tenant_of(K1)],
                                  env={"AGENTD_URL": url, "AGENTD_API_KEY": K2})
        assert as_tenant.exit_code != 0 and "admin key" in as_tenant.output
        as_admin = runner.invoke(main, ["unpin", "agent", "--owner", tenant_of(K1)],
                                 env={"AGENTD_URL": url, "AGENTD_API_KEY": ADMIN})
        assert as_admin.exit_code == 0, as_admin.output
        assert httpx.get(f"{url}/v1/pins", headers=auth(K1)).json()["data"] == []


def test_status_with_a_tenants_key_says_what_it_may_see(tiny, serve) -> None:
    from click.testing import CliRunner

    from agentd.cli import main

    config, engine = tiny
    settings = ServerSettings(api_keys=(K1, K2), admin_keys=(ADMIN,))
    with serve(create_app(config, engine=engine, settings=settings)) as url:
        runner = CliRunner()
        tenant = runner.invoke(main, ["status"], env={"AGENTD_URL": url, "AGENTD_API_KEY": K1})
        assert tenant.exit_code == 0, tenant.output
        assert "running" in tenant.output and "need an admin key" in tenant.output
        assert "tiny-llama" in tenant.output
        admin = runner.invoke(main, ["status", "--json"],
                              env={"AGENTD_URL": url, "AGENTD_API_KEY": ADMIN})
        assert admin.exit_code == 0 and "num_blocks_used" in admin.output
