"""What a restart does with what is on disk: a pin's KV comes back from the block store only when
every record of it is there and verifies, and anything wrong is recomputed (and said so);
``pins.json`` loses nothing to one bad entry, to a torn or garbled file (its backup), or to a pin
that could not be restored; records no pin needs leave the pinned class; a model with other
weights never restores another's KV; an older version's KV snapshots are migrated into the store
once and removed; pins' KV is written off the engine thread.

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

from agentd.cache import PinKey
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


def store_of(state_dir: Path) -> Path:
    (path,) = state_dir.glob("kv-store/*-b16")
    return path


def pinned_segments(state_dir: Path) -> list[Path]:
    """The store's pinned segments, oldest first: the first life wrote alpha's, then beta's."""
    return sorted(store_of(state_dir).glob("*.pin.seg"))


def segment_of(state_dir: Path, name: str) -> Path:
    return pinned_segments(state_dir)[list(SYSTEMS).index(name)]


def restored_and_replies(model: Path, state_dir: Path, **config: Any) -> tuple[list, dict]:
    """The restore report, and per pin (cached tokens, greedy reply) after the restart."""
    async def body(engine, service, report):
        return report, {name: await ask(engine, system) for name, system in SYSTEMS.items()
                        if any(p["name"] == name for p in await service.list())}

    return restart(model, state_dir, body, **config)


# --- 1. the stored KV: checksums, torn and missing records ----------------------------------
def _flip_a_byte_in_each_record(path: Path) -> None:
    """One byte in the middle of each record's payload: every header still verifies."""
    data = bytearray(path.read_bytes())
    record = len(data) // _num_records(data)
    for start in range(0, len(data), record):
        data[start + record // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _num_records(data: bytes) -> int:
    return data.count(b"AKVB")


CORRUPTIONS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "a byte flipped in each block": (lambda path, other: _flip_a_byte_in_each_record(path),
                                     "failed its checks"),
    "truncated": (lambda path, other: path.write_bytes(path.read_bytes()[:4096]),
                  "not in the store"),
    "random bytes": (lambda path, other: path.write_bytes(os.urandom(path.stat().st_size)),
                     "not in the store"),
    "deleted": (lambda path, other: path.unlink(), "not in the store"),
    "another pin's segment in its place": (lambda path, other: shutil.copy(other, path),
                                           "not in the store"),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_damaged_stored_kv_is_recomputed_and_the_report_says_why(model, first_life, state,
                                                                 how: str) -> None:
    corrupt, reason = CORRUPTIONS[how]
    corrupt(segment_of(state, "alpha"), segment_of(state, "beta"))
    report, replies = restored_and_replies(model, state)
    by_name = {entry["name"]: entry for entry in report}
    assert by_name["alpha"]["source"] == "recompute", report
    assert reason in by_name["alpha"]["kv_error"], report
    assert by_name["beta"]["source"] == "store", report
    for name, info in first_life["infos"].items():  # both serve, as a never-restarted engine
        num_cached, reply = replies[name]
        assert num_cached >= info["num_tokens"]
        assert reply == first_life["replies"][name]
    report, _ = restored_and_replies(model, state)  # the recompute stored alpha again, whole
    assert {e["name"]: e["source"] for e in report} == {"alpha": "store", "beta": "store"}


# --- 2. another model with the same shapes -----------------------------------------------------
def test_a_model_with_other_weights_never_restores_anothers_snapshot(model, first_life, state,
                                                                     tiny_model_factory) -> None:
    other = tiny_model_factory("llama", seed=1)  # the same config, other weights

    async def body(engine, service, report):
        assert engine.engine.loaded.fingerprint != first_life["fingerprint"]
        return report, {name: await ask(engine, system) for name, system in SYSTEMS.items()}

    first_store = store_of(state)
    report, replies = restart(other, state, body)
    assert [entry["source"] for entry in report] == ["recompute", "recompute"], report
    assert all("not in the store" in entry["kv_error"] for entry in report), report

    async def uncached(engine, service, report):
        return {name: (await ask(engine, system))[1] for name, system in SYSTEMS.items()}

    expected = restart(other, state.with_name("empty"), uncached, enable_prefix_caching=False)
    assert {name: reply for name, (_, reply) in replies.items()} == expected
    assert expected != first_life["replies"]  # the two models do differ
    # each model has its own store; the first one's pins' records are ordinary blocks now
    # (within that store's budget when it is next opened), not pinned outside any budget
    stores = sorted(p.name for p in (state / "kv-store").iterdir())
    assert len(stores) == 2 and first_store.name in stores
    assert first_life["fingerprint"] in first_store.name
    assert not list(first_store.glob("*.pin.seg")) and list(first_store.glob("*.seg"))


# --- 6. a tenant's pin ------------------------------------------------------------------------
def test_a_tenants_pin_comes_back_in_its_name_space_with_its_salt(model, tmp_path) -> None:
    owner = "ab12"

    async def first(engine, service, report):
        await service.add(PinSpec("alpha", SYSTEMS["beta"]))  # a server-wide pin of that name
        return await service.add(PinSpec("alpha", SYSTEMS["alpha"], owner=owner))

    info = restart(model, tmp_path, first)
    assert info["owner"] == owner
    assert len(pinned_segments(tmp_path)) == 2  # the same text, two salts: two sets of records

    async def second(engine, service, report):
        assert {(e.get("owner"), e["source"]) for e in report} == {
            (None, "store"), (owner, "store")}, report
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
        "alpha": "store", "beta": "store"}
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
        "alpha": "store", "beta": "store"}
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
    assert len(pinned_segments(state)) == 3  # alpha's and beta's still pinned, and short's
    report, replies = restored_and_replies(model, state)  # room again: all three come back
    assert {e["name"]: e["source"] for e in report} == {
        "alpha": "store", "beta": "store", "short": "store"}
    assert {name: reply for name, (_, reply) in replies.items()} == first_life["replies"]


def test_records_no_pin_needs_leave_and_stray_snapshots_are_removed(model, first_life,
                                                                     state) -> None:
    alpha, beta = segment_of(state, "alpha"), segment_of(state, "beta")
    stray = [state / "kv" / "fp-b16" / "ghost.pt", state / "kv" / "fp-b16" / "ghost.pt.xxh3",
             state / "kv" / "fp-b16" / "tenant-ab12" / "old.pt", state / "kv" / "0123-b32" / "x.pt"]
    for path in stray:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    doc = json.loads((state / "pins.json").read_text())
    doc["pins"] = [p for p in doc["pins"] if p["name"] == "alpha"]
    (state / "pins.json").write_text(json.dumps(doc))  # beta unregistered by hand
    report, _ = restored_and_replies(model, state)
    assert [(e["name"], e["source"]) for e in report] == [("alpha", "store")]
    assert not (state / "kv").exists()  # no pin names those snapshots
    assert pinned_segments(state) == [alpha] and not beta.exists()  # no disk tier: deleted


def test_unpinned_records_become_ordinary_blocks_of_the_disk_tier(model, first_life, state
                                                                  ) -> None:
    beta = segment_of(state, "beta")

    async def body(engine, service, report):
        await service.remove("beta")
        return engine.engine.disk.store.stats()

    stats = restart(model, state, body, kv_disk_dir=str(state / "kv-store"))
    assert pinned_segments(state) == [segment_of(state, "alpha")]
    assert not beta.exists() and beta.with_name(beta.name.replace(".pin", "")).exists()
    assert stats.pinned_bytes == segment_of(state, "alpha").stat().st_size
    assert stats.num_bytes >= beta.with_name(beta.name.replace(".pin", "")).stat().st_size


# --- 5. an older version's snapshots are migrated ----------------------------------------------
def test_an_older_versions_snapshots_are_restored_once_then_kept_in_the_store(model, first_life,
                                                                              tmp_path) -> None:
    state = tmp_path / "old"

    async def old_version(engine, service, report):
        """What the previous version left: pins.json and a KV snapshot a pin, no store."""
        for name, system in SYSTEMS.items():
            await service.add(PinSpec(name, system))
            payload = await engine.gather_pin_snapshot(PinKey(None, name))
            pin_snapshots.write_snapshot(payload, service._snapshot_path(PinKey(None, name)),
                                         state)
        service._store.clear()
        for segment in store_of(state).glob("*.seg"):
            segment.unlink()

    restart(model, state, old_version)
    shutil.rmtree(state / "kv-store")
    assert len(list(state.glob("kv/*/*.pt"))) == 2
    report, replies = restored_and_replies(model, state)
    assert {e["name"]: e["source"] for e in report} == {"alpha": "snapshot", "beta": "snapshot"}
    assert {name: reply for name, (_, reply) in replies.items()} == first_life["replies"]
    assert not (state / "kv").exists() and len(pinned_segments(state)) == 2
    report, replies = restored_and_replies(model, state)
    assert {e["name"]: e["source"] for e in report} == {"alpha": "store", "beta": "store"}
    assert {name: reply for name, (_, reply) in replies.items()} == first_life["replies"]


# --- 4. pins' KV is written off the engine thread ----------------------------------------------
def test_the_engine_serves_while_a_pins_kv_is_written(model, tmp_path, monkeypatch) -> None:
    """The write holds halfway for 8 s (the crash tests' hook): a request sent meanwhile is
    answered before the pin's records are all written. Written on the engine thread, it
    waited."""
    monkeypatch.setenv("AGENTD_TEST_PAUSE_PIN_KV_S", "8")

    async def body(engine, service, report):
        adding = asyncio.create_task(service.add(PinSpec("alpha", SYSTEMS["alpha"])))
        while not any(p.stat().st_size for p in tmp_path.glob("kv-store/*/*.pin.seg")):
            assert not adding.done(), adding.result()
            await asyncio.sleep(0.02)
        await ask(engine, "You are a plain assistant.")
        written = adding.done()
        await adding
        return written

    assert restart(model, tmp_path, body) is False  # answered while the write was held


# --- 9. 10. permissions and names on disk ------------------------------------------------------
def test_state_files_are_private(first_life) -> None:
    state_dir = first_life["state_dir"]
    assert state_dir.stat().st_mode & 0o777 == 0o700
    files = [p for p in [state_dir, *state_dir.rglob("*")]]
    assert any(p.name.endswith(".pin.seg") for p in files)
    assert (state_dir / "pins.json.bak").exists()
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
