"""The tree's layout holds: the import graph of agentd runs one way (no module imports, however
indirectly, a module that imports it back; read from the source with ``ast``: every ``import``
of an agentd module, lazy ones inside functions and those for annotations alone, under
``TYPE_CHECKING``, included), no two modules share a basename, and no source file of the
packages is over ``MAX_LINES`` lines (C++ headers included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the distribution maps these directories to packages (design §1)
PACKAGES = {"agentd": ROOT / "agentd", "agentd.cache": ROOT / "cache",
            "agentd.kernels": ROOT / "kernels", "agentd.cli": ROOT / "cli"}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if name.startswith("agentd.cli") and package == "agentd":
                continue
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    return {t for t in targets if t in known and t != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_import_graph_has_no_cycles() -> None:
    found = modules()
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    assert len(graph) > 100 and graph["agentd.engine.llm_engine"], "the graph was not read"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


MAX_LINES = 500
SOURCE_SUFFIXES = (".py", ".h", ".cpp")


def sources() -> list[Path]:
    return sorted(path for directory in PACKAGES.values() for path in directory.rglob("*")
                  if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts)


def test_no_two_modules_share_a_basename() -> None:
    seen: dict[str, list[str]] = {}
    for path in sources():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert len(seen) > 100, "the tree was not read"
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, shared


def test_no_source_file_is_longer_than_the_limit() -> None:
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for path in sources()}
    assert max(lengths.values()) > MAX_LINES // 2, "the tree was not read"
    assert not {p: n for p, n in lengths.items() if n > MAX_LINES}
