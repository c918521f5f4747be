"""Compile the CPU kernels once per source change and load them in well under a second after.

The extension is built by ``torch.utils.cpp_extension.load`` (ninja) into
``<agentd cache dir>/kernels/<config>/<sources>/``: ``config`` digests what every object file
depends on besides its sources (torch and Python versions, the compiler binary, the flags),
``sources`` digests every source and header. A process that finds the built library imports it
directly, without asking ninja. A new build starts from a copy of the newest build of the same
config, so ninja recompiles only the files that changed (bindings.cpp, the one file that
includes torch, takes most of a build). The base flags never say ``-march=native``: each kernel
file names its own instruction set (``#pragma GCC target``) and ``dispatch.cpp`` picks among
them by cpuid, so one build runs on any x86-64.

Invariant: a build directory is complete or absent. Builds happen under an exclusive file lock
in a ``.partial`` directory that is renamed into place only after the library loaded, so
processes building at once never see (or corrupt) each other's half-written files. A failed
build leaves a ``.failed`` note (with the compiler's error) that later processes read instead
of failing the same compile again; ``build()`` retries regardless.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from agentd.model.paths import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
# Always compiled; the K-quant files (kquants_*.cpp) join when they compile, and their types are
# offered only then (dispatch.cpp links them as weak symbols).
CORE_SOURCES = ("bindings.cpp", "dispatch.cpp", "simple_scalar.cpp", "simple_avx2.cpp",
                "simple_avx512.cpp", "ops_bindings.cpp", "ops_scalar.cpp", "ops_avx2.cpp",
                "ops_avx512.cpp", "ops_prefill_bf16.cpp")
# -fopenmp: at::parallel_for is inline code that runs its body on the calling thread alone
# unless the file is compiled with OpenMP (_OPENMP); linked with it, the library needs
# libgomp.so.1, which is torch's own copy once torch is loaded (one thread pool, sized by
# torch.set_num_threads). Without it every product and attention call of a 2-thread daemon ran
# on one thread: an 8B Q4_K_M decode step took the same 305 ms with 1 thread or 2.
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Loaded:
    """Attributes:
        module: the extension, or None when no build could be loaded.
        reason: why there is no module (what the user can do about it), else None.
        left_out: why some sources (the K-quant files) are not in the module, else None.
    """

    module: ModuleType | None
    reason: str | None = None
    left_out: str | None = None


def _compiler() -> str | None:
    """$CXX if set (torch compiles with it), else c++."""
    return shutil.which(os.environ.get("CXX") or "c++")


MODULE_NAME = "agentd_cpu"  # fixed, so unchanged files compile to the same command line
KEEP_BUILDS = 3  # per config: the newest ones, which running daemons may still have mapped


def _config_digest(compiler: str) -> str:
    real = Path(compiler).resolve()
    stat = real.stat()
    parts = (torch.__version__, sys.version, str(real), str(stat.st_size), str(stat.st_mtime_ns),
             " ".join(CFLAGS), " ".join(LDFLAGS))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _sources_digest(sources: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(set(sources) | set(SOURCE_DIR.glob("*.h"))):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _complete_builds(config_dir: Path) -> list[Path]:
    """This config's finished build directories, newest first."""
    done = [p for p in config_dir.iterdir() if p.is_dir() and (p / f"{MODULE_NAME}.so").exists()
            and "." not in p.name]
    return sorted(done, key=lambda p: p.stat().st_mtime, reverse=True)


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise BuildError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs ``ninja`` from PATH; a daemon started as ``.venv/bin/agentd`` without an
    activated venv has the PyPI ninja next to its interpreter but not on PATH."""
    old = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _compile(sources: list[Path], directory: Path, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    with _ninja_on_path():
        if shutil.which("ninja") is None:
            raise BuildError("ninja is not installed (pip install ninja)")
        return cpp_extension.load(
            MODULE_NAME, [str(s) for s in sources], extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(SOURCE_DIR)], build_directory=str(directory),
            verbose=verbose, with_cuda=False)


def _load_or_build(sources: list[Path], compiler: str, verbose: bool, retry: bool) -> ModuleType:
    config_dir = default_cache_dir() / "kernels" / _config_digest(compiler)
    digest = _sources_digest(sources)
    final, failed = config_dir / digest, config_dir / f"{digest}.failed"
    library = final / f"{MODULE_NAME}.so"  # torch's extension suffix on Linux
    if library.exists():
        return _import(MODULE_NAME, library)
    if failed.exists() and not retry:
        raise BuildError(failed.read_text())
    config_dir.mkdir(parents=True, exist_ok=True)
    with open(config_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        if library.exists():  # another process built it while this one waited
            return _import(MODULE_NAME, library)
        partial = config_dir / f"{digest}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        previous = _complete_builds(config_dir)
        if previous:  # copy2 keeps mtimes, so ninja sees which objects are still up to date
            shutil.copytree(previous[0], partial, copy_function=shutil.copy2)
        else:
            partial.mkdir()
        logger.info("compiling agentd's CPU kernels into %s (once per source change)", final)
        try:
            module = _compile(sources, partial, verbose)
        except Exception as exc:  # a compiler error, a missing header, a killed job
            message = str(exc).strip()[-4000:] or type(exc).__name__
            failed.write_text(message)
            shutil.rmtree(partial, ignore_errors=True)
            raise BuildError(message) from exc
        failed.unlink(missing_ok=True)
        os.replace(partial, final)
        for old in _complete_builds(config_dir)[KEEP_BUILDS:]:
            shutil.rmtree(old, ignore_errors=True)
        return module


def load(verbose: bool = False, retry: bool = False) -> Loaded:
    """Build (if needed) and import the extension; never raises for a failed build."""
    compiler = _compiler()
    if compiler is None:
        return Loaded(None, "no C++ compiler (c++/g++ on PATH)")
    core = [SOURCE_DIR / s for s in CORE_SOURCES]
    extra = sorted(p for p in SOURCE_DIR.glob("*.cpp") if p.name not in CORE_SOURCES)
    left_out = None
    if extra:
        try:
            return Loaded(_load_or_build(core + extra, compiler, verbose, retry))
        except BuildError as exc:
            left_out = (f"{', '.join(p.name for p in extra)} did not compile "
                        f"({_last_error_line(str(exc))})")
    try:
        return Loaded(_load_or_build(core, compiler, verbose, retry), left_out=left_out)
    except BuildError as exc:
        return Loaded(None, f"the CPU kernels did not compile: {_last_error_line(str(exc))}")


def _last_error_line(message: str) -> str:
    """The compiler's first ``error:`` line (ninja's own summary says only that a step failed)."""
    lines = message.splitlines()
    for marker in (": error:", "error", ""):
        found = [line.strip() for line in lines if marker in line.lower() and line.strip()]
        if found:
            return found[0][:300]
    return "unknown error"
