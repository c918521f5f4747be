"""The real coding agents, on their defaults, against a real daemon on the default model.

Claude Code, Codex CLI and opencode (pinned versions from npm) each run a two-turn session in a
scratch project: once configured by hand with only what the client's own docs name for a
custom endpoint, once through ``agentd launch``. A recording proxy between client and daemon
(``agentd.bench.record``) keeps every exchange, and the session is judged on the protocol, not
the answer (the default model is a 135M model): every request gets a 2xx; turn 2's first request
that carries turn 1's prompt finds at least 90% of it in the prefix cache (the daemon's own
usage); the client prints no API error and exits 0.

These run in the ``full`` set, not in CI: the clients' first prompts are 7.7k-20k tokens, and
the cold prefill of Claude Code's alone takes minutes on a 2-core CPU, past the suite's 10-minute
budget. The clients are installed once with npm into ``$AGENTD_CLIENTS_DIR`` (default
``~/.cache/agentd/clients``, outside the repository); without npm the module is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentd.bench.record import recording

pytestmark = [pytest.mark.full, pytest.mark.slow]

CLIENT_PACKAGES = {  # npm package -> its pinned version (the versions recorded in docs/agents.md)
    "@anthropic-ai/claude-code": "2.1.197",
    "@openai/codex": "0.171.0",
    "opencode-ai": "1.18.33",
}
MODEL = "SmolLM2-135M-Instruct"
TURN_TIMEOUT_S = 1800  # a cold 20k-token prefill on 2 cores, and a reply
CLIENT_ERRORS = ("API Error", "ERROR:", "AI_APICallError", "Error: ")
CAPPED = ("incomplete:max_output_tokens", "length", "max_tokens")  # a reply cut at its cap
# what Codex and Claude Code print (and exit 1 with) for a reply cut at their cap, as they do
# against OpenAI's and Anthropic's APIs; the test's cap is short so that the default model's
# rambling stays within minutes, and the notice is accepted only where the records show the cut
CAPPED_NOTICES = ("Incomplete response returned, reason: max_output_tokens",
                  "output token maximum. To configure this behavior")


@pytest.fixture(scope="module")
def client_bin() -> Path:
    """The npm bin directory holding claude, codex and opencode at their pinned versions."""
    root = Path(os.environ.get("AGENTD_CLIENTS_DIR",
                               Path.home() / ".cache" / "agentd" / "clients"))
    bin_dir = root / "node_modules" / ".bin"
    wanted = [f"{name}@{version}" for name, version in CLIENT_PACKAGES.items()]
    installed = all(
        _installed_version(root, name) == version for name, version in CLIENT_PACKAGES.items())
    if not installed:
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: the real coding clients come from npm")
        root.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([npm, "install", "--prefix", str(root), "--no-audit", "--no-fund",
                                 "--save-exact", *wanted], capture_output=True, text=True,
                                timeout=900)
        if result.returncode != 0:
            pytest.skip(f"npm install {' '.join(wanted)} failed: {result.stderr[-500:]}")
    return bin_dir


def _installed_version(root: Path, package: str) -> str | None:
    try:
        manifest = root / "node_modules" / package / "package.json"
        return json.loads(manifest.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


OUTPUT_CAP = 64  # the daemon's --max-output-tokens, and what each client is told to ask


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, daemon_process) -> Iterator:
    """``agentd start`` on its defaults (the default model, served at 32,768 tokens) but for a
    short output cap: the default model decodes 3-5 tokens/s at these contexts on 2 cores, and
    the protocol, not the answer, is what is judged."""
    with daemon_process(tmp_path_factory.mktemp("agents") / "state",
                        "--max-output-tokens", str(OUTPUT_CAP)) as daemon:
        yield daemon


@dataclass
class Session:
    """A client's two turns: their records, outputs and exit codes."""

    records: list[list[dict]]
    outputs: list[str]
    codes: list[int]

    def judge(self) -> None:
        for turn, (output, code) in enumerate(zip(self.outputs, self.codes, strict=True)):
            capped = any(r.get("finish") in CAPPED for r in self.records[turn])
            errors = [line for line in output.splitlines()
                      if any(mark in line for mark in CLIENT_ERRORS)
                      and not (capped and any(n in line for n in CAPPED_NOTICES))]
            assert not errors, f"turn {turn + 1} printed errors: {errors}"
            assert code == 0 or (capped and any(n in output for n in CAPPED_NOTICES)), (
                f"turn {turn + 1} exited {code}:\n{output[-3000:]}")
        for turn, records in enumerate(self.records):
            assert records, f"turn {turn + 1} sent no request"
            refused = [(r["method"], r["path"], r["status"], r.get("reply")) for r in records
                       if not 200 <= r["status"] < 300]
            assert not refused, f"turn {turn + 1}: {refused}"
        generated = [r for r in self.records[0] if r.get("usage")]
        assert generated, "turn 1 got no reply with usage"
        first = max(r["usage"]["prompt_tokens"] for r in generated)
        later = [r["usage"] for r in self.records[1]
                 if r.get("usage") and r["usage"]["prompt_tokens"] >= first]
        assert later, f"no request of turn 2 carries turn 1's {first}-token prompt"
        cached = later[0]["cached_tokens"]
        assert cached >= 0.9 * first, (
            f"turn 2 found {cached} of turn 1's {first} prompt tokens in the cache")


def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    (root / "hello.py").write_text('print("hello")\n')
    (root / "README.md").write_text("# Demo project\nA tiny scratch project.\n")
    (root / "data.csv").write_text("a,b\n1,2\n")
    return root


def run_turns(argvs: list[list[str]], env: dict[str, str], cwd: Path, daemon_url: str,
              prepare: Callable[[str], None] = lambda url: None) -> Session:
    """Each argv (with ``{url}`` for the recorder's URL) in turn, through one recorder."""
    session = Session([], [], [])
    with recording(daemon_url) as (url, recorder):
        prepare(url)
        for argv in argvs:
            seen = len(recorder.records)
            argv = [part.replace("{url}", url) for part in argv]
            turn_env = {k: v.replace("{url}", url) for k, v in env.items()}
            result = subprocess.run(argv, cwd=cwd, env=turn_env, stdin=subprocess.DEVNULL,
                                    capture_output=True, text=True, timeout=TURN_TIMEOUT_S)
            session.outputs.append(result.stdout + result.stderr)
            session.codes.append(result.returncode)
            session.records.append(recorder.records[seen:])
    return session


def base_env(tmp_path: Path, client_bin: Path) -> dict[str, str]:
    """A clean user: a scratch HOME, the clients and node on PATH, nothing else inherited."""
    home = tmp_path / "home"
    home.mkdir()
    return {"HOME": str(home), "TERM": "dumb",
            "PATH": os.pathsep.join([str(client_bin), "/usr/local/bin", "/usr/bin", "/bin"])}


BY_HAND = {
    "claude": (["claude", "-p", "List the files in this directory"],
               ["claude", "-p", "--continue", "Now show the contents of hello.py"]),
    "codex": (["codex", "exec", "--skip-git-repo-check", "List the files in this directory"],
              ["codex", "exec", "--skip-git-repo-check", "resume", "--last",
               "Now show the contents of hello.py"]),
    "opencode": (["opencode", "run", "List the files in this directory"],
                 ["opencode", "run", "--continue", "Now show the contents of hello.py"]),
}


def by_hand_setup(client: str, env: dict[str, str], root: Path) -> None:
    """What each client's docs say to set for a custom endpoint, and nothing more."""
    if client == "claude":
        env.update(ANTHROPIC_BASE_URL="{url}", ANTHROPIC_AUTH_TOKEN="unused",
                   ANTHROPIC_MODEL=MODEL, ANTHROPIC_SMALL_FAST_MODEL=MODEL,
                   CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(OUTPUT_CAP))
    elif client == "codex":
        codex_home = Path(env["HOME"]) / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "agentd"\n\n[model_providers.agentd]\n'
            'name = "agentd"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
            'env_key = "AGENTD_API_KEY"\n')
        env["AGENTD_API_KEY"] = "unused"
    else:
        (root / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"agentd": {"npm": "@ai-sdk/openai-compatible", "name": "agentd",
                                    "options": {"baseURL": "{url}/v1", "apiKey": "unused"},
                                    "models": {MODEL: {"name": MODEL, "limit": {
                                        "context": 32768, "output": OUTPUT_CAP}}}}},
            "model": f"agentd/{MODEL}"}))


def fill_url_in_files(root: Path, env: dict[str, str], url: str) -> None:
    for path in [root / "opencode.json", Path(env["HOME"]) / ".codex" / "config.toml"]:
        if path.exists():
            path.write_text(path.read_text().replace("{url}", url))


@pytest.mark.parametrize("client", sorted(BY_HAND))
def test_a_client_configured_by_hand_runs_two_turns(client, client_bin, daemon, tmp_path):
    root = project(tmp_path)
    env = base_env(tmp_path, client_bin)
    by_hand_setup(client, env, root)
    run_turns(list(BY_HAND[client]), env, root, daemon.url,
              prepare=lambda url: fill_url_in_files(root, env, url)).judge()


@pytest.mark.parametrize("client", sorted(BY_HAND))
def test_a_client_run_by_agentd_launch_runs_two_turns(client, client_bin, daemon, tmp_path):
    root = project(tmp_path)
    env = base_env(tmp_path, client_bin)
    launch = [sys.executable, "-m", "agentd.cli", "launch", client, "--url", "{url}", "--"]
    turns = [launch + argv[1:] for argv in BY_HAND[client]]
    run_turns(turns, env, root, daemon.url).judge()
