"""API keys: with ``--api-key`` (several allowed) and ``--admin-key`` every ``/v1`` and ``/admin``
operation in the app's own OpenAPI schema — so routes added later are covered without editing
this test — answers 401 without a key, with a wrong key or another scheme, and does not with any
of the keys; with several tenant keys, the operator's routes (``/admin``, ``/v1/stats``) answer
403 to a tenant and not to the admin key. ``/health`` stays open; ``/metrics`` needs an
operator's key unless ``--metrics-public``. The CLI sends ``$AGENTD_API_KEY``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from litestar.testing import TestClient

from agentd.cli import main
from agentd.cli.start import command as start_command
from agentd.cli.start import server_settings
from agentd.server.app import ServerSettings, create_app

LOCAL = "http://127.0.0.1"  # a Host header the daemon answers to (testserver.local is not)

KEYS = ("sk-alpha", "sk-beta")
ADMIN = "sk-admin"
OPERATOR_PATHS = ("/admin/", "/v1/stats")
BAD_HEADERS = {
    "no header": {},
    "wrong key": {"Authorization": "Bearer sk-gamma"},
    "a key's prefix": {"Authorization": "Bearer sk-alph"},
    "basic scheme": {"Authorization": f"Basic {KEYS[0]}"},
    "no scheme": {"Authorization": KEYS[0]},
    "empty bearer": {"Authorization": "Bearer "},
    "two keys at once": {"Authorization": f"Bearer {KEYS[0]},{KEYS[1]}"},
    "wrong x-api-key": {"x-api-key": "sk-gamma"},
    "a good x-api-key under a bad bearer": {"Authorization": "Bearer sk-gamma",
                                            "x-api-key": KEYS[0]},
}


@pytest.fixture(scope="module")
def keyed(tiny) -> Iterator[TestClient]:
    config, engine = tiny
    app = create_app(config, engine=engine, settings=ServerSettings(api_keys=KEYS,
                                                                   admin_keys=(ADMIN,)))
    with TestClient(app, base_url=LOCAL) as client:
        yield client


def guarded_operations(client: TestClient) -> list[tuple[str, str]]:
    schema = client.get("/docs/openapi.json").json()
    operations = [(method.upper(), path.replace("{name}", "some-pin"))
                  for path, item in schema["paths"].items()
                  if path.startswith(("/v1/", "/admin/"))
                  for method in item if method in ("get", "post", "put", "patch", "delete")]
    assert ("POST", "/v1/chat/completions") in operations and ("GET", "/v1/stats") in operations
    return operations


def test_every_v1_and_admin_operation_needs_a_key(keyed: TestClient, openai_error) -> None:
    for method, path in guarded_operations(keyed):
        for case, headers in BAD_HEADERS.items():
            response = keyed.request(method, path, headers=headers)
            if path.startswith("/v1/messages"):  # Anthropic's routes answer in its shape
                assert response.status_code == 401, (method, path, case)
                assert response.json()["error"]["type"] == "authentication_error"
                continue
            error = openai_error(response, 401)
            assert error["code"] == "invalid_api_key", (method, path, case)
            assert error["type"] == "authentication_error"
        if path.startswith("/v1/messages"):  # Anthropic's header carries a key as well
            response = keyed.request(method, path, headers={"x-api-key": KEYS[0]}, json={})
            assert response.status_code == 400, response.text


@pytest.mark.parametrize("key", [*KEYS, ADMIN])
def test_each_key_is_accepted_everywhere(keyed: TestClient, key: str, idle) -> None:
    bodies: dict[str, Any] = {"/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/pins": {"name": "auth-probe", "system": "You are a probe. " * 8}}
    for scheme in ("Bearer", "bearer"):
        headers = {"Authorization": f"{scheme} {key}"}
        for method, path in guarded_operations(keyed):
            if path == "/admin/shutdown":
                continue  # accepted (202) would ask the server to exit
            response = keyed.request(method, path, headers=headers, json=bodies.get(path))
            assert response.status_code != 401, (method, path, response.text)
            assert response.status_code < 500, (method, path, response.text)
            if path.startswith(OPERATOR_PATHS):  # a tenant is refused, the operator is not
                assert (response.status_code == 403) == (key != ADMIN), (method, path, key)
        keyed.delete("/v1/pins/auth-probe", headers=headers)
    idle(lambda path: keyed.get(path, headers={"Authorization": f"Bearer {ADMIN}"}),
         num_pinned_ok=False)


def test_health_and_docs_stay_open_and_metrics_needs_an_operator(keyed: TestClient, tiny,
                                                                 openai_error) -> None:
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/docs/openapi.json").status_code == 200
    assert openai_error(keyed.get("/metrics"), 401)["code"] == "invalid_api_key"
    tenant = keyed.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert openai_error(tenant, 403)["code"] == "permission_denied"
    admin = keyed.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 200 and b"vllm:" in admin.content
    config, engine = tiny
    public = ServerSettings(api_keys=KEYS, metrics_public=True)
    with TestClient(create_app(config, engine=engine, settings=public), base_url=LOCAL) as client:
        assert client.get("/metrics").status_code == 200
    one_tenant = ServerSettings(api_keys=KEYS[:1])  # one key: its holder is the operator
    with TestClient(create_app(config, engine=engine, settings=one_tenant),
                    base_url=LOCAL) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}
                          ).status_code == 200


def test_start_accepts_several_keys_by_option_or_environment() -> None:
    ctx = start_command.make_context("start", ["--api-key", "k1", "--api-key", "k2,k3"])
    assert server_settings(ctx.params).api_keys == ("k1", "k2", "k3")
    runner_env = {"AGENTD_API_KEY": "k1,k2", "AGENTD_MAX_QUEUE": "7",
                  "AGENTD_SHARED_CACHE": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in runner_env.items():
            patch.setenv(name, value)
        ctx = start_command.make_context("start", [])
    settings = server_settings(ctx.params)
    assert settings.api_keys == ("k1", "k2") and settings.max_queue == 7
    assert settings.shared_cache and not settings.per_key_cache
    ctx = start_command.make_context("start", ["--api-key", "k1,k2", "--admin-key", "root",
                                               "--metrics-public"])
    settings = server_settings(ctx.params)
    assert settings.admin_keys == ("root",) and settings.metrics_public
    assert settings.is_operator("root") and not settings.is_operator("k1")


@pytest.fixture(scope="module")
def keyed_url(tiny, serve) -> Iterator[str]:
    config, engine = tiny
    settings = ServerSettings(api_keys=KEYS, shared_cache=True)  # one tenant: keys are operators
    with serve(create_app(config, engine=engine, settings=settings)) as url:
        yield url


@pytest.mark.parametrize("args", [["status", "--json"], ["pins"], ["stats", "--json"]])
def test_the_cli_sends_the_key_from_the_environment(keyed_url: str, args: list[str]) -> None:
    runner = CliRunner()
    for key in (KEYS[1], ",".join(KEYS)):  # one key, or the list given to `agentd start`
        result = runner.invoke(main, args, env={"AGENTD_URL": keyed_url, "AGENTD_API_KEY": key})
        assert result.exit_code == 0, result.output
    for env in ({"AGENTD_API_KEY": "sk-wrong"}, {"AGENTD_API_KEY": ""}):
        result = runner.invoke(main, args, env={"AGENTD_URL": keyed_url, **env})
        assert result.exit_code != 0
        assert "AGENTD_API_KEY" in result.output, result.output
