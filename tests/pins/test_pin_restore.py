"""What a restart does with what is on disk: every KV snapshot is checked against its checksum and
its pin, and anything wrong is recomputed (and said so); ``pins.json`` loses nothing to one bad
entry, to a torn or garbled file (its backup), or to a pin that could not be restored; snapshots
no pin names are removed; a model with other weights never restores another's KV; snapshots are
written off the engine thread.

One module-wide first life pins two prompts and records the greedy reply a never-restarted
engine gives; each test restarts over a copy of that state dir after damaging it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import xxhash

from agentd.chat import render_chat
from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.pins import snapshots as pin_snapshots
from agentd.pins.manager import tenant_salt
from agentd.pins.service import PinService, PinSpec

KV_BYTES = 8 * 2**20  # 1,024 blocks of 16 tokens for the tiny llama
QUESTION = "Which sources would you read first?"
_WORKLOAD = json.loads(resources.files("agentd.workloads").joinpath("research_agent.json")
                       .read_text())["system"]
SYSTEMS = {"alpha": _WORKLOAD[:1500], "beta": _WORKLOAD[1500:3000]}
Body = Callable[[AsyncEngine, PinService, list[dict[str, Any]]], Awaitable[Any]]


def restart(model: Path, state_dir: Path, body: Body, **config: Any) -> Any:
    """Start an engine on ``state_dir``, restore its pins, run ``body``, stop the engine."""
    async def run() -> Any:
        engine = AsyncEngine.from_config(EngineConfig(model=str(model),
                                                      kv_cache_memory_bytes=KV_BYTES, **config))
        engine.start()
        try:
            service = PinService(engine, state_dir)
            return await body(engine, service, await service.restore_all())
        finally:
            engine.shutdown()

    return asyncio.run(run())


async def ask(engine: AsyncEngine, system: str, salt: str | None = None
              ) -> tuple[int, list[int]]:
    """(cached prompt tokens, 8 greedy tokens) of QUESTION under ``system``."""
    prompt = render_chat(engine.tokenizer, [{"role": "system", "content": system},
                                            {"role": "user", "content": QUESTION}],
                         None, None).prompt_token_ids
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    deltas = [d async for d in engine.add_request(EngineRequest(prompt, params, cache_salt=salt))]
    return deltas[-1].num_cached_tokens, [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def first_life(model, tmp_path_factory) -> dict[str, Any]:
    """Pin alpha and beta; the state dir they leave and the replies of that same engine."""
    state_dir = tmp_path_factory.mktemp("first-life")

    async def body(engine, service, report):
        assert report == []
        infos = {name: await service.add(PinSpec(name, system)) for name, system in SYSTEMS.items()}
        replies = {name: (await ask(engine, system))[1] for name, system in SYSTEMS.items()}
        fingerprint = engine.engine.loaded.fingerprint
        return {"infos": infos, "replies": replies, "fingerprint": fingerprint}

    return {**restart(model, state_dir, body), "state_dir": state_dir}


@pytest.fixture
def state(first_life, tmp_path) -> Path:
    """A private copy of the first life's state dir."""
    copy = tmp_path / "state"
    shutil.copytree(first_life["state_dir"], copy)
    return copy


def snapshot_of(state_dir: Path, name: str) -> Path:
    (path,) = state_dir.glob(f"kv/*/{name}.pt")
    return path


def restored_and_replies(model: Path, state_dir: Path, **config: Any) -> tuple[list, dict]:
    """The restore report, and per pin (cached tokens, greedy reply) after the restart."""
    async def body(engine, service, report):
        return report, {name: await ask(engine, system) for name, system in SYSTEMS.items()
                        if any(p["name"] == name for p in await service.list())}

    return restart(model, state_dir, body, **config)


# --- 1. KV snapshots: checksum, load errors, mismatches --------------------------------------
def _flip_kv_sign_bits(path: Path) -> None:
    """Flip the sign bit of the floats in the middle half of the file — all KV data, 4-byte
    aligned in any snapshot format: a file that still loads, with every value negated."""
    data = bytearray(path.read_bytes())
    for index in range(len(data) // 4 // 4 * 4 + 3, len(data) * 3 // 4, 4):
        data[index] ^= 0x80
    path.write_bytes(bytes(data))


def _with_a_matching_checksum(path: Path, content: bytes) -> None:
    path.write_bytes(content)
    pin_snapshots.checksum_path(path).write_text(json.dumps(
        {"xxh3_128": xxhash.xxh3_128_hexdigest(content),
         "num_bytes": len(content)}))


CORRUPTIONS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "sign bits flipped": (lambda path, other: _flip_kv_sign_bits(path), "do not match"),
    "truncated": (lambda path, other: path.write_bytes(path.read_bytes()[:4096]),
                  "its checksum says"),
    "random bytes": (lambda path, other: path.write_bytes(os.urandom(path.stat().st_size)),
                     "do not match"),
    "no checksum": (lambda path, other: pin_snapshots.checksum_path(path).unlink(),
                    "no checksum"),
    "not a snapshot, checksum right": (
        lambda path, other: _with_a_matching_checksum(path, b"not a snapshot at all\n"),
        "cannot be loaded"),
    "another pin's snapshot": (
        lambda path, other: [shutil.copy(other, path), shutil.copy(
            pin_snapshots.checksum_path(other), pin_snapshots.checksum_path(path))],
        "tokens differ"),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_damaged_snapshot_is_recomputed_and_the_report_says_why(model, first_life, state,
                                                                  how: str) -> None:
    corrupt, reason = CORRUPTIONS[how]
    corrupt(snapshot_of(state, "alpha"), snapshot_of(state, "beta"))
    report, replies = restored_and_replies(model, state)
    by_name = {entry["name"]: entry for entry in report}
    assert by_name["alpha"]["source"] == "recompute", report
    assert reason in by_name["alpha"]["snapshot_error"], report
    assert by_name["beta"]["source"] == "snapshot", report
    for name, info in first_life["infos"].items():  # both serve, as a never-restarted engine
        num_cached, reply = replies[name]
        assert num_cached >= info["num_tokens"]
        assert reply == first_life["replies"][name]
    assert pin_snapshots.read_snapshot(snapshot_of(state, "alpha"))["kv"].numel()  # rewritten whole


# --- 2. another model with the same shapes -----------------------------------------------------
def test_a_model_with_other_weights_never_restores_anothers_snapshot(model, first_life, state,
                                                                     tiny_model_factory) -> None:
    other = tiny_model_factory("llama", seed=1)  # the same config, other weights

    async def body(engine, service, report):
        assert engine.engine.loaded.fingerprint != first_life["fingerprint"]
        return report, {name: await ask(engine, system) for name, system in SYSTEMS.items()}

    report, replies = restart(other, state, body)
    assert [entry["source"] for entry in report] == ["recompute", "recompute"], report
    assert not any("snapshot_error" in entry for entry in report)  # never even looked at

    async def uncached(engine, service, report):
        return {name: (await ask(engine, system))[1] for name, system in SYSTEMS.items()}

    expected = restart(other, state.with_name("empty"), uncached, enable_prefix_caching=False)
    assert {name: reply for name, (_, reply) in replies.items()} == expected
    assert expected != first_life["replies"]  # the two models do differ
    # the first model's snapshots are gone: a model no longer in use
    assert [p.name for p in (state / "kv").iterdir()] == [snapshot_of(state, "alpha").parent.name]
    assert first_life["fingerprint"] not in snapshot_of(state, "alpha").parent.name


# --- 6. a tenant's pin ------------------------------------------------------------------------
def test_a_tenants_pin_comes_back_in_its_name_space_with_its_salt(model, tmp_path) -> None:
    owner = "ab12"

    async def first(engine, service, report):
        await service.add(PinSpec("alpha", SYSTEMS["beta"]))  # a server-wide pin of that name
        return await service.add(PinSpec("alpha", SYSTEMS["alpha"], owner=owner))

    info = restart(model, tmp_path, first)
    assert info["owner"] == owner
    assert list((tmp_path / "kv").glob(f"*/tenant-{owner}/alpha.pt"))

    async def second(engine, service, report):
        assert {(e.get("owner"), e["source"]) for e in report} == {
            (None, "snapshot"), (owner, "snapshot")}, report
        assert [p["owner"] for p in await service.list(owner)] == [owner]
        return (await ask(engine, SYSTEMS["alpha"], tenant_salt(owner)))[0], \
            (await ask(engine, SYSTEMS["alpha"]))[0]

    salted, unsalted = restart(model, tmp_path, second)
    assert salted >= info["num_tokens"] and unsalted == 0


# --- 3. the registry ---------------------------------------------------------------------------
def registry_names(state_dir: Path, file: str = "pins.json") -> list[str]:
    return [entry["name"] for entry in json.loads((state_dir / file).read_text())["pins"]]


def test_bad_entries_are_skipped_and_reported_and_the_rest_restored(model, first_life,
                                                                   state) -> None:
    path = state / "pins.json"
    doc = json.loads(path.read_text())
    doc["pins"][0]["colour"] = "blue"  # an unknown field: kept, reported
    doc["pins"][1:1] = [{"name": "gamma", "system": 5}, "not an entry",
                        {"name": "bad\n", "system": "x"}, {**doc["pins"][0], "ttl_s": -1}]
    damaged = json.dumps(doc)
    path.write_text(damaged)
    report, replies = restored_and_replies(model, state)
    errors = [entry["error"] for entry in report if entry["name"] == "pins.json"]
    assert len(errors) == 5, report
    assert any("colour" in e and "ignored" in e for e in errors), errors
    assert sum("skipped" in e for e in errors) == 4, errors
    assert {e["name"]: e["source"] for e in report if "source" in e} == {
        "alpha": "snapshot", "beta": "snapshot"}
    assert {name: reply for name, (_, reply) in replies.items()} == first_life["replies"]
    assert registry_names(state) == ["alpha", "beta"]  # rewritten clean...
    assert (state / "pins.json.rejected").read_text() == damaged  # ... the original kept


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty", "not a registry"])
def test_an_unreadable_registry_falls_back_to_its_backup(model, first_life, state,
                                                         damage: str) -> None:
    restored_and_replies(model, state)  # a clean start: the registry it loaded is the backup
    path = state / "pins.json"
    text = path.read_text()
    path.write_bytes({"truncated": text[:len(text) // 2].encode(), "random bytes": os.urandom(300),
                      "empty": b"", "not a registry": b'["alpha", "beta"]'}[damage])

    async def body(engine, service, report):
        report = list(report)
        await service.add(PinSpec("delta", SYSTEMS["alpha"][:400]))  # the next pin keeps all
        return report

    report = restart(model, state, body)
    assert [e["name"] for e in report if "error" in e] == ["pins.json"], report
    assert "unreadable" in report[0]["error"]
    assert {e["name"]: e["source"] for e in report if "source" in e} == {
        "alpha": "snapshot", "beta": "snapshot"}
    assert registry_names(state) == ["alpha", "beta", "delta"]
    assert registry_names(state, "pins.json.bak") == ["alpha", "beta"]


def test_a_pin_that_cannot_be_restored_stays_registered(model, first_life, state) -> None:
    async def body(engine, service, report):
        report = list(report)
        await service.add(PinSpec("short", "You are brief. " * 8))
        return report

    report = restart(model, state, body, max_model_len=256)  # alpha and beta no longer fit
    assert {e["name"] for e in report if "error" in e} == {"alpha", "beta"}, report
    assert sorted(registry_names(state)) == ["alpha", "beta", "short"]
    assert snapshot_of(state, "alpha").exists()  # still named by the registry: kept
    report, replies = restored_and_replies(model, state)  # room again: all three come back
    assert {e["name"]: e["source"] for e in report} == {
        "alpha": "snapshot", "beta": "snapshot", "short": "snapshot"}
    assert {name: reply for name, (_, reply) in replies.items()} == first_life["replies"]


def test_snapshots_no_pin_names_are_removed(model, first_life, state) -> None:
    alpha = snapshot_of(state, "alpha")
    stray = [alpha.with_name("ghost.pt"), alpha.with_name("ghost.pt.xxh3"),
             alpha.parent / "tenant-ab12" / "old.pt",
             state / "kv" / "0123abcd-b16" / "alpha.pt", state / "kv" / "0123abcd-b32" / "x.pt"]
    for path in stray:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    doc = json.loads((state / "pins.json").read_text())
    doc["pins"] = [p for p in doc["pins"] if p["name"] == "alpha"]
    (state / "pins.json").write_text(json.dumps(doc))  # beta unregistered by hand
    report, _ = restored_and_replies(model, state)
    assert [e["name"] for e in report] == ["alpha"]
    assert not any(p.exists() for p in stray)
    assert not (state / "kv" / "0123abcd-b16").exists()
    assert sorted(p.name for p in alpha.parent.rglob("*")) == ["alpha.pt", "alpha.pt.xxh3"]


# --- 4. snapshots are written off the engine thread ------------------------------------------
def test_the_engine_serves_while_a_snapshot_is_written(model, tmp_path, monkeypatch) -> None:
    """The write holds in the middle for 8 s (the crash tests' hook): a request sent meanwhile
    is answered before the snapshot is committed. Written on the engine thread, it waited."""
    monkeypatch.setenv("AGENTD_TEST_PAUSE_SNAPSHOT_S", "8")

    async def body(engine, service, report):
        adding = asyncio.create_task(service.add(PinSpec("alpha", SYSTEMS["alpha"])))
        while not list(tmp_path.glob("kv/*/.alpha.pt.*.tmp")):
            assert not adding.done(), adding.result()
            await asyncio.sleep(0.02)
        await ask(engine, "You are a plain assistant.")
        written = bool(list(tmp_path.glob("kv/*/alpha.pt")))
        await adding
        return written

    assert restart(model, tmp_path, body) is False  # answered while the write was held


# --- 9. 10. permissions and names on disk ------------------------------------------------------
def test_state_files_are_private(first_life) -> None:
    state_dir = first_life["state_dir"]
    assert state_dir.stat().st_mode & 0o777 == 0o700
    files = [p for p in [state_dir, *state_dir.rglob("*")]]
    assert any(p.name == "alpha.pt.xxh3" for p in files) and (state_dir / "pins.json.bak").exists()
    for path in files:
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path


def test_older_looser_files_are_tightened_at_start(model, state) -> None:
    for path in [state, *state.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    restored_and_replies(model, state)
    for path in [state, *state.rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path


def test_snapshot_file_names_are_injective() -> None:
    names = ["abc\n", "abc_", "abc_0a", "ABC", "abc", "Abc", "a.b", "a-b", "a_b", "ä", "_c3_a4",
             "a/b", "..", "abc\r\n"]
    stems = [pin_snapshots.file_stem(n) for n in names]
    assert len(set(stems)) == len(names), dict(zip(names, stems, strict=True))
    assert len({s.lower() for s in stems}) == len(names)  # a case-insensitive disk too
    assert all("/" not in s and s not in (".", "..") for s in stems)
    paths = {pin_snapshots.snapshot_path(Path("/s"), "fp", 16, owner, "p")
             for owner in (None, "ab", "ab12")}
    assert len(paths) == 3
