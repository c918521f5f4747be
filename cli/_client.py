"""The CLI's HTTP client for a running daemon.

Invariants: the base URL is ``--url``, else ``$AGENTD_URL``, else ``http://127.0.0.1:8000``;
``Authorization: Bearer $AGENTD_API_KEY`` is sent when that variable is set (its first key,
when it lists several for ``agentd start``); every failure a user can fix (nothing listening, a
missing key, an error reply) becomes a ``click.ClickException`` that says what to do.
"""

from __future__ import annotations

import os
from typing import Any

import click
import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENVVAR = "AGENTD_URL"
API_KEY_ENVVAR = "AGENTD_API_KEY"

url_option = click.option(
    "--url", envvar=URL_ENVVAR, show_envvar=True, default=DEFAULT_URL, show_default=True,
    help="Base URL of the daemon.",
)


class DaemonUnreachable(click.ClickException):
    """Nothing answers at the URL."""

    def __init__(self, url: str) -> None:
        super().__init__(f"no agentd daemon at {url}; start one with `agentd start`")
        self.url = url


class DaemonClient:
    def __init__(self, url: str | None = None, api_key: str | None = None,
                 timeout_s: float = 10.0) -> None:
        self.url = (url or os.environ.get(URL_ENVVAR) or DEFAULT_URL).rstrip("/")
        if self.url.endswith("/v1"):  # accept the OpenAI base URL too
            self.url = self.url[: -len("/v1")]
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENVVAR)
        api_key = (api_key or "").split(",")[0].strip()  # the daemon's own list: use the first
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s,
                                  trust_env=False)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send a request; raise ``DaemonUnreachable`` when nothing listens."""
        try:
            return self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise DaemonUnreachable(self.url) from exc
        except httpx.TransportError as exc:
            raise click.ClickException(
                f"the daemon at {self.url} did not answer {method} {path}: {exc}"
            ) from exc

    def health(self) -> dict[str, Any]:
        """``GET /health`` as JSON, whatever its status (503 while the model loads)."""
        response = self.request("GET", "/health")
        try:
            return response.json()
        except ValueError as exc:
            raise click.ClickException(
                f"{self.url} answered /health with something other than agentd's JSON; is "
                "another server on that port?"
            ) from exc

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON body of a successful reply; an error reply becomes a ClickException."""
        return self.check(self.request(method, path, **kwargs), method, path).json()

    def check(self, response: httpx.Response, method: str, path: str) -> httpx.Response:
        """``response`` if it succeeded; an error reply becomes a ClickException."""
        if response.status_code == 401:
            raise click.ClickException(
                f"the daemon at {self.url} requires an API key; set {API_KEY_ENVVAR}"
            )
        if response.is_error:
            raise click.ClickException(f"{method} {path} failed: {error_message(response)}")
        return response

    def close(self) -> None:
        self._http.close()


def error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def error_code(response: httpx.Response) -> str | None:
    """The ``code`` of an OpenAI-shaped error reply, if it has one."""
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None
