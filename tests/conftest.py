"""Shared fixtures: the default model's files, tiny random models per architecture, and chat
templates in the styles of other model families.

Tiny models reuse the default model's real tokenizer (SmolLM2, 49,152 tokens) so that prompts are
real text; their weights are random, with a wide init so that greedy choices are not near-ties.
A tiny model can carry another chat template (``tiny_model_factory("llama", template="qwen")``):
a Qwen2.5-style one that renders tools inside ``<tools></tools>`` in the system turn, or a
Llama-3.1-style one that puts them in the first user turn.

``daemon_process`` hands tests the one way they start a real daemon: ``python -m agentd.cli
start`` on a free loopback port, exactly as a user runs it, and ``default_daemon`` is the one
such daemon with the default model that the end-to-end modules share; ``serve`` runs an app
under uvicorn in a thread instead, and ``poll`` waits for a condition.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from agentd.bench.spawn import DaemonNotReady, SpawnedDaemon, free_port

QWEN_STYLE_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + message.content }}
        {%- for tc in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + tc.function.name + '", "arguments": ' }}
            {{- tc.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3_STYLE_TEMPLATE = """
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if loop.first and tools is not none %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
        {{- 'Given the following functions, respond with a JSON for a function call.\\n\\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
        {{- message.content + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {%- set tc = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + tc.name + '", "parameters": ' }}
        {{- tc.arguments | tojson }}
        {{- '}<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
        {{- message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHAT_TEMPLATES = {"qwen": QWEN_STYLE_TEMPLATE, "llama3": LLAMA3_STYLE_TEMPLATE}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from agentd.model.loader import resolve_model

    return resolve_model(None).path


def tiny_config(model_type: str, vocab_size: int = 49152):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, initializer_range=0.25, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if model_type == "llama":
        return transformers.LlamaConfig(**common)
    if model_type == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if model_type == "qwen2":
        return transformers.Qwen2Config(**common)
    if model_type == "qwen3":
        return transformers.Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32)
    raise ValueError(model_type)


def build_tiny_model(root: Path, model_type: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    import transformers

    path = root / (f"tiny-{model_type}" + (f"-seed{seed}" if seed else ""))
    if path.exists():
        return path
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def with_chat_template(model_dir: Path, name: str) -> Path:
    """A copy of ``model_dir`` (weights linked, not copied) whose chat template is ``name``'s."""
    path = model_dir.with_name(f"{model_dir.name}-{name}")
    if path.exists():
        return path
    path.mkdir()
    for item in model_dir.iterdir():
        if item.name != "chat_template.jinja":
            (path / item.name).symlink_to(item)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATES[name])
    return path


@pytest.fixture(scope="session")
def chat_templates() -> dict[str, str]:
    return dict(CHAT_TEMPLATES)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("tiny-models")

    def make(model_type: str, template: str | None = None, seed: int = 0) -> Path:
        """``seed``: another draw of the same shapes (other weights, same config)."""
        path = build_tiny_model(root, model_type, default_model_dir, seed)
        return path if template is None else with_chat_template(path, template)

    return make


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N`` each worker, and every daemon it starts, takes its share of the
    cores: N workers that each ran torch on every core would spin against each other."""
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if num_workers > 1:
        num_threads = max(1, len(os.sched_getaffinity(0)) // num_workers)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)  # for the daemons it starts
        torch.set_num_threads(num_threads)
    if hasattr(config.option, "loadscopereorder"):
        # xdist hands out files by their number of tests, most first, unless told not to: the
        # one-test e2e modules (the router's, the pins', ~55 s and ~30 s) went last, one
        # worker idle while the other ran them. The collection order below is the one kept.
        config.option.loadscopereorder = False


# Under xdist the two workers take whole files (`--dist loadfile`) in collection order, so a
# long module collected last leaves one worker idle while the other finishes it. The longest
# go first (seconds of test time on 2 cores, junit of `pytest -n 2`, 2026-12-05).
LONGEST_FIRST = (
    "model/test_equivalence.py",  # ~89 s: tiny models of four families against transformers
    "server/test_e2e.py",  # ~88 s: the default model, its exact mode too
    "hardening/test_crash.py",  # ~72 s: kill -9 and restarts of a daemon
    "cli/test_bench.py",  # ~67 s
    "hardening/test_fuzz.py",  # ~65 s
    "server/test_structured_e2e.py",  # ~60 s: the code-editing agent's prefix, cold
    "engine/test_closing.py",  # ~55 s
    "examples/test_examples.py",  # ~55 s
    "engine/test_spec_engine.py",  # ~47 s
    "server/test_cluster_e2e.py",  # ~45 s: a 2-replica cluster behind SMG (3 processes)
    "model/test_default_model.py",  # ~45 s
    "server/test_kv_disk_e2e.py",  # ~40 s: a daemon killed and restarted
    "model/test_gguf_model.py",  # ~43 s
    "engine/test_kv_tier.py",  # ~35 s
    "model/test_gguf_header.py",  # ~38 s
    "hardening/test_isolation.py",  # ~35 s
    "server/test_pins_e2e.py",  # ~31 s
    "model/test_packed_linear.py",  # ~33 s
    "kernels/test_decode_attention.py",  # ~31 s
    "model/test_weight_accuracy.py",  # ~31 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    root = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        relative = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return LONGEST_FIRST.index(relative) if relative in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's tests keep their order


# Tests that run tiny models in-process run single-threaded: tiny models gain nothing from
# threads, and on a busy 2-core machine OpenMP's spin-waiting makes a 2-thread forward of a tiny
# model up to 100x slower.
SINGLE_THREADED_DIRS = ("engine", "model")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread_for_tiny_models(request) -> Iterator[None]:
    if request.path.parent.name not in SINGLE_THREADED_DIRS:
        yield
        return
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# oneDNN's bfloat16 paths need AVX512-BW/VL/DQ or AVX-NE-CONVERT, which it reads from the CPU
# itself (no environment variable hides them). This makes the daemon's two probes answer as they
# do on an AVX2-only CPU: packing a bf16 linear raises torch's own error, and there are no bf16
# GEMMs. AGENTD_TEST_CPU_WITHOUT_BF16=1 applies it to a whole pytest run.
NO_BF16_ERROR = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert "
                 "or avx512bw, avx512vl and avx512dq")


def simulate_cpu_without_bf16(setattr_: Callable[[Any, str, Any], None] = setattr) -> None:
    from agentd.kernels import _common

    mkldnn = torch.ops.mkldnn
    reorder = mkldnn._reorder_linear_weight

    def reorder_without_bf16(weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(NO_BF16_ERROR)
        return reorder(weight, *args, **kwargs)

    setattr_(mkldnn, "_reorder_linear_weight", reorder_without_bf16)
    setattr_(mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    _common._bf16_gemm.cache_clear()


if os.environ.get("AGENTD_TEST_CPU_WITHOUT_BF16") == "1":
    simulate_cpu_without_bf16()


@pytest.fixture
def cpu_without_bf16(monkeypatch) -> Iterator[None]:
    """Within one test, the daemon's oneDNN probes answer as on an AVX2-only CPU."""
    from agentd.kernels import _common

    simulate_cpu_without_bf16(monkeypatch.setattr)
    yield
    monkeypatch.undo()
    _common._bf16_gemm.cache_clear()


class DaemonProcess(SpawnedDaemon):
    """:class:`agentd.bench.spawn.SpawnedDaemon` for tests: ``start()`` returns the daemon and
    fails the test with its log if it does not come up; as a context manager it is started on
    entry and stopped gracefully on exit, where it must exit 0."""

    def start(self, wait: bool = True) -> DaemonProcess:  # type: ignore[override]
        try:
            super().start(wait)
        except DaemonNotReady as exc:
            pytest.fail(str(exc))
        return self

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """Run ``agentd ARGS --url <this daemon>`` as a user would."""
        return subprocess.run([sys.executable, "-m", "agentd.cli", *args, "--url", self.url],
                              capture_output=True, text=True, env=self.env, timeout=600)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        code = self.stop()
        if exc_info[0] is None:
            assert code == 0, f"the daemon exited with {code}:\n{self.log()}"


def poll(get: Callable[[], Any], until: Callable[[Any], bool], timeout_s: float = 60.0) -> Any:
    """Call ``get`` until ``until(value)``; return that value (fail after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not until(value := get()):
        assert time.monotonic() < deadline, f"gave up waiting; last: {value}"
        time.sleep(0.05)
    return value


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port; yields the base URL."""
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0), backlog=2048)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    poll(lambda: server.started, bool, timeout_s=30)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="session")
def serve() -> Callable[[Any], Any]:
    return serve_in_thread


@pytest.fixture(name="poll", scope="session")
def poll_fixture() -> Callable[..., Any]:
    return poll


@pytest.fixture(scope="session", name="free_port")
def free_port_fixture():
    """``free_port()``: a loopback port nothing listens on (at the time of the call)."""
    return free_port


@pytest.fixture(scope="session")
def daemon_process() -> type[DaemonProcess]:
    """The :class:`DaemonProcess` class (test modules cannot import from conftest)."""
    return DaemonProcess


@pytest.fixture(scope="module")
def tiny_server(tiny_model_factory) -> Iterator[tuple[str, Any]]:
    """A tiny llama served on loopback in this process: (its URL, its AsyncEngine)."""
    from agentd.config import EngineConfig
    from agentd.engine.async_engine import AsyncEngine
    from agentd.server.app import create_app

    config = EngineConfig(model=str(tiny_model_factory("llama")), kv_cache_memory_bytes=8 * 2**20)
    engine = AsyncEngine.from_config(config)
    engine.start()
    try:
        with serve_in_thread(create_app(config, engine=engine)) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def default_daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    """One ``agentd start`` with the default model and its default settings, shared by every
    end-to-end module that needs nothing else of a daemon (no pool size of its own, no
    restart): loading the default model is most of such a module's cost. A module that
    registers something on it names it its own way; it must exit 0 at the end of the session."""
    with DaemonProcess(tmp_path_factory.mktemp("default-daemon") / "state",
                       "--log-level", "warning") as daemon:
        yield daemon


@pytest.fixture(scope="session")
def exact_daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    """The default model in the exact mode (``--weights float32``), for the tests that hold
    outputs to be the same alone, batched and on a cached prefix: the default mode serves the
    Q4_1 file through int8 products, whose rounding turns the last-bit differences of another
    batch or attention split into different greedy tokens where two are close."""
    with DaemonProcess(tmp_path_factory.mktemp("exact-daemon") / "state",
                       "--log-level", "warning", "--weights", "float32") as daemon:
        yield daemon


CAPPED_ADDRESS_SPACE_BYTES = 3 * 2**30  # a tiny model's engine peaks near 1.2 GiB of it
CAPPED_TIMEOUT_S = 600  # a hang guard only: the children here take seconds


def run_capped(code: str, *args: str,
               max_bytes: int = CAPPED_ADDRESS_SPACE_BYTES) -> subprocess.CompletedProcess:
    """Run ``python -c code args`` with its address space capped at ``max_bytes``: where the
    code under test would take memory without end, the child fails (xgrammar's
    ``std::bad_alloc``, a MemoryError) instead of the machine."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          preexec_fn=cap, env=env, timeout=CAPPED_TIMEOUT_S)


@pytest.fixture(scope="session", name="run_capped")
def run_capped_fixture() -> Callable[..., subprocess.CompletedProcess]:
    """``run_capped(code, *args)``: a Python child under a memory cap (``run_capped``)."""
    return run_capped
