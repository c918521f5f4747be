"""The README's commands work as written on a fresh machine, in order.

Every ``$`` command of every console block in README.md, examples/agents/README.md and the
reference pages docs/*.md runs through ``.venv/bin/`` (what ``bash .ci/setup`` makes) or names a
file of the repository (a page without a console block has no command to check); the
agents quickstart itself runs, command by command as the README spells them, against a real
daemon. Its environment only moves the daemon off the user's own: a free port, its own state
dir, and a tiny model (so it is quick; ``AGENTD_MODEL`` is one of ``agentd start``'s documented
variables), in a scratch directory that holds the repository's ``.venv`` and ``examples``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from agentd.bench.spawn import child_environ

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
READMES = [ROOT / "README.md", ROOT / "examples" / "agents" / "README.md",
           *(page for page in DOCS if "```console" in page.read_text())]
QUICKSTART = "## Agents quickstart"
_BLOCK = re.compile(r"^```console\n(.*?)^```", re.S | re.M)


def console_commands(text: str) -> list[str]:
    """The ``$`` commands of every console block, a heredoc joined to its command."""
    commands: list[str] = []
    for block in _BLOCK.findall(text):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if not line.startswith("$ "):
                continue  # the output shown
            command = line[2:]
            if match := re.search(r"<<'?(\w+)'?", command):
                end = lines.index(match.group(1), i)
                command = "\n".join([command, *lines[i:end + 1]])
                i = end + 1
            commands.append(command)
    return commands


def programs(command: str) -> list[list[str]]:
    """The simple commands of a ``;``/``&&`` list (a heredoc's body left out), as words."""
    first_line = command.split("\n", 1)[0]
    words = shlex.split(first_line, comments=True)
    out: list[list[str]] = [[]]
    for word in words:
        if word in ("&&", ";", "||"):
            out.append([])
        elif word.endswith(";"):
            out[-1].append(word[:-1])
            out.append([])
        else:
            out[-1].append(word)
    return [words for words in out if words and not words[0].startswith("<<")]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_readme_command_runs_from_the_venv_or_the_repository(readme: Path) -> None:
    commands = console_commands(readme.read_text())
    assert commands
    for command in commands:
        for words in programs(command):
            program = words[0]
            if program == "bash":
                assert (ROOT / words[1]).is_file(), command
                continue
            assert program.startswith(".venv/bin/"), (
                f"{command!r} needs `.venv/bin/{program}` (or `source .venv/bin/activate` "
                "first): after `bash .ci/setup` it is not on PATH")
            assert program.removeprefix(".venv/bin/") in ("agentd", "python"), command
            if program.endswith("python") and len(words) > 1 and words[1].endswith(".py"):
                assert (ROOT / words[1]).is_file(), command


def test_the_readme_quickstart_runs_as_written(tmp_path: Path, tiny_model_factory,
                                               free_port) -> None:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(QUICKSTART):]
    commands = console_commands(section[:section.index("\n## ", 3)])
    assert commands[0].startswith(".venv/bin/agentd start --detach")
    work = tmp_path / "clone"
    work.mkdir()
    for name in (".venv", "examples"):
        (work / name).symlink_to(ROOT / name)
    port = free_port()
    env = child_environ()
    env.update(AGENTD_PORT=str(port), AGENTD_URL=f"http://127.0.0.1:{port}",
               AGENTD_HOME=str(tmp_path / "state"), AGENTD_KV_CACHE_MEMORY="48MiB",
               AGENTD_MODEL=str(tiny_model_factory("llama")))
    outputs: list[str] = []
    try:
        for command in commands:
            done = subprocess.run(["bash", "-c", command], cwd=work, env=env, text=True,
                                  capture_output=True, timeout=600)
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            outputs.append(done.stdout)
    finally:
        subprocess.run([str(ROOT / ".venv/bin/agentd"), "stop"], env=env, cwd=work,
                       capture_output=True, timeout=120)
    by_command = dict(zip(commands, outputs, strict=True))
    assert (work / "prompt.txt").read_text() and (work / "tools.json").read_text()
    pin = next(out for cmd, out in by_command.items() if " pin " in cmd)
    assert re.match(r"pinned research_agent: \d+ tokens", pin), pin
    agent = next(out for cmd, out in by_command.items() if "pinned_agent.py" in cmd)
    assert "pin 'research_agent' is already there" in agent  # one pin for the prompt
    cached = [int(n) for n in re.findall(r"cached tokens (\d+) of", agent)]
    assert cached and all(n > 0 for n in cached), agent
    parallel = next(out for cmd, out in by_command.items() if "parallel_agents.py" in cmd)
    assert "pin 'research_agent' is already there" in parallel, parallel
    pins = next(out for cmd, out in by_command.items() if "agentd pins" in cmd)
    assert len(re.findall(r"^\s*research_agent\s+\d", pins, re.M)) == 1, pins
