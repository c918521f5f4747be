"""Records a coding agent's session against a daemon, for ``benchmarks/harness_replay.py``.

    python benchmarks/harness_record.py --url http://127.0.0.1:8000 --client claude \
        [--turns 11] [--out benchmarks/sessions/claude.jsonl.gz]

Runs the real client (claude, codex or opencode, on PATH) through ``agentd launch`` in a
scratch project with a scratch HOME, one turn per prompt below (turn 1 starts the session, each
later one continues it: ``claude -p --continue``, ``codex exec resume --last``, ``opencode run
--continue``), through a recording proxy (``agentd.bench.record``), and writes every exchange,
gzipped. A turn's output and exit status are printed; the recording keeps whatever the client
sent, errors too (the replay skips what was refused).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentd.bench.record import recording

PROMPTS = [
    "List the files in this directory.",
    "Show me the contents of hello.py.",
    "What columns does data.csv have?",
    "Add a function to hello.py that returns the sum of column a of data.csv.",
    "Write a test for that function in test_hello.py.",
    "Explain what README.md says about this project.",
    "Rename the function you added to sum_column.",
    "Add a docstring to sum_column.",
    "Add a row 3,4 to data.csv.",
    "What would the sum of column a be now?",
    "Summarize every change we made in this session.",
]
FIRST = {"claude": ["-p"], "codex": ["exec", "--skip-git-repo-check"], "opencode": ["run"]}
LATER = {"claude": ["-p", "--continue"], "codex": ["exec", "--skip-git-repo-check", "resume",
                                                   "--last"],
         "opencode": ["run", "--continue"]}


def scratch_project(root: Path) -> None:
    (root / "hello.py").write_text('print("hello")\n')
    (root / "README.md").write_text("# Demo project\nA tiny scratch project.\n")
    (root / "data.csv").write_text("a,b\n1,2\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--client", required=True, choices=sorted(FIRST))
    parser.add_argument("--turns", type=int, default=len(PROMPTS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds per turn.")
    args = parser.parse_args()
    out = args.out or Path(__file__).parent / "sessions" / f"{args.client}.jsonl.gz"
    if shutil.which(args.client) is None:
        sys.exit(f"{args.client} is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        root, home = Path(tmp) / "project", Path(tmp) / "home"
        root.mkdir()
        home.mkdir()
        scratch_project(root)
        env = {"HOME": str(home), "TERM": "dumb", "PATH": os.environ["PATH"]}
        with recording(args.url, label=args.client) as (url, recorder):
            for turn, prompt in enumerate(PROMPTS[:args.turns]):
                argv = [sys.executable, "-m", "agentd.cli", "launch", args.client, "--url", url,
                        "--", *(LATER if turn else FIRST)[args.client], prompt]
                start = time.perf_counter()
                result = subprocess.run(argv, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                        capture_output=True, text=True, timeout=args.timeout)
                print(f"turn {turn + 1}: exit {result.returncode} in "
                      f"{time.perf_counter() - start:.1f} s, {len(recorder.records)} requests so "
                      f"far; output: {(result.stdout + result.stderr).strip()[-300:]!r}",
                      flush=True)
            records = list(recorder.records)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(f"{len(records)} exchanges -> {out}")


if __name__ == "__main__":
    main()
