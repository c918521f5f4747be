"""KV events end to end: a real ``agentd start --kv-events`` (tiny model, a small pool) and a ZMQ
subscriber that replays the stream as a router would. After a pin, requests that share prefixes,
unique prompts worth twice the pool (evictions) and a restart that restores the pin, the
subscriber's block set equals the pool's hashed blocks (``/admin/integrity``'s digest), and no
block of the pin is ever reported removed. The disk tier under the pool reports its own blocks
(medium ``DISK``): the subscriber's disk set matches the store's block count, also after the
restart (the blocks the store holds are announced again after ``AllBlocksCleared``).
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from agentd.cache import blocks_digest
from agentd.engine.kv_publisher import END_SEQ, WireAllBlocksCleared, WireBlockStored, decode_batch

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq: pip install 'agentd[cluster]'")
pytestmark = pytest.mark.slow

# tiny llama: 512 bytes of fp32 KV per token, so 512 KiB holds 64 blocks of 16 tokens
DAEMON_ARGS = ("--kv-cache-memory", "512KiB", "--max-model-len", "512", "--num-threads", "1",
               "--speculative", "off")


class Subscriber:
    """A router's view of one replica: vLLM's SUB + replay protocol, replayed into a set."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.blocks: set[bytes] = set()  # the pool's (medium CPU)
        self.disk: set[bytes] = set()  # the disk tier's (medium DISK)
        self.last_seq: int | None = None
        self.topics: set[bytes] = set()
        self.removed: set[bytes] = set()  # every hash ever reported removed

    def apply(self, seq: int, payload: bytes) -> None:
        for event in decode_batch(payload).events:
            if isinstance(event, WireAllBlocksCleared):
                self.blocks.clear()
                self.disk.clear()
            elif event.medium == "DISK":
                if isinstance(event, WireBlockStored):
                    self.disk.update(event.block_hashes)
                else:
                    self.disk.difference_update(event.block_hashes)
            elif isinstance(event, WireBlockStored):
                assert event.medium == "CPU"
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                self.blocks.update(event.block_hashes)
            else:
                self.blocks.difference_update(event.block_hashes)
                self.removed.update(event.block_hashes)
        self.last_seq = seq

    def resync(self) -> None:
        """Ask for every buffered batch from seq 0 (a restarted replica starts there, with
        AllBlocksCleared) and rebuild the set from them."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        self.blocks.clear()
        self.disk.clear()
        while True:
            assert dealer.poll(10_000), "no answer from the replay socket"
            _, seq_bytes, payload = dealer.recv_multipart()
            if seq_bytes == END_SEQ:
                break
            self.apply(int.from_bytes(seq_bytes, "big"), payload)
        dealer.close(0)

    def drain(self, timeout_ms: int = 200) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq is not None and seq <= self.last_seq and seq != 0:
                continue  # replayed already
            if seq != (0 if self.last_seq is None else self.last_seq + 1):
                self.resync()  # a gap (or a restart we joined late): start over from 0
                continue
            self.apply(seq, payload)

    def sync_with(self, url: str, timeout_s: float = 30.0) -> dict:
        """Drain until the set matches the pool (events are asynchronous); the last report."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            report = httpx.get(f"{url}/admin/integrity", timeout=30).json()
            if blocks_digest(self.blocks) == report["hashed_blocks_digest"]:
                return report
            assert time.monotonic() < deadline, (
                f"the subscriber holds {len(self.blocks)} blocks, the pool "
                f"{report['num_hashed_blocks']}, and they differ")

    def sync_disk(self, url: str, timeout_s: float = 30.0) -> int:
        """Drain until the disk set holds as many blocks as the store, its writes done."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            disk = httpx.get(f"{url}/v1/stats", timeout=30).json()["kv_disk"]
            if not disk["write_queue_blocks"] and len(self.disk) == disk["num_blocks"]:
                return disk["num_blocks"]
            assert time.monotonic() < deadline, (len(self.disk), disk)
            time.sleep(0.05)

    def close(self) -> None:
        self.sub.close(0)
        self.context.term()


def completion(url: str, token_ids: list[int]) -> dict:
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": token_ids, "max_tokens": 2,
                                                      "temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_events_replay_to_the_pool_through_pins_evictions_and_a_restart(
        tmp_path, tiny_model_factory, daemon_process, free_port) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = daemon_process(tmp_path / "state", "--model", str(tiny_model_factory("llama")),
                            *DAEMON_ARGS, "--kv-events", endpoint,
                            "--kv-events-replay", replay_endpoint)
    subscriber = Subscriber(endpoint, replay_endpoint)
    rng = random.Random(0)
    try:
        daemon.start()
        subscriber.resync()  # whatever was sent before we connected
        report = subscriber.sync_with(daemon.url)
        assert report["num_hashed_blocks"] == 0
        pinned = httpx.post(f"{daemon.url}/v1/pins", timeout=120, json={
            "name": "router", "system": "You are the routing agent. " * 40})
        assert pinned.status_code == 201, pinned.text
        subscriber.sync_with(daemon.url)
        pin_blocks = set(subscriber.blocks)  # the pin's full blocks (its tail has no hash)
        assert len(pin_blocks) == pinned.json()["num_tokens"] // 16 > 10

        stem = [rng.randrange(1000, 40000) for _ in range(100)]
        for _ in range(3):  # a shared stem: stored once, then hit
            completion(daemon.url, stem + [rng.randrange(1000, 40000) for _ in range(40)])
        stats = httpx.get(f"{daemon.url}/v1/stats").json()
        assert stats["prefix_cache_hits"] >= 2 * 96
        for _ in range(2 * stats["num_blocks_total"] // 19):  # unique prompts: evictions
            completion(daemon.url, [rng.randrange(1000, 40000) for _ in range(19 * 16)])
            subscriber.drain(timeout_ms=0)
        report = subscriber.sync_with(daemon.url)
        assert subscriber.removed, "twice the pool in unique prompts evicted nothing"
        assert not subscriber.removed & pin_blocks, "a pinned block was reported removed"
        assert pin_blocks <= subscriber.blocks
        assert report["num_blocks_pinned"] == pinned.json()["num_blocks"]  # its tail too
        assert subscriber.sync_disk(daemon.url) > len(subscriber.blocks)  # more than the pool's
        assert subscriber.blocks & subscriber.disk

        daemon.kill()  # kill -9: the pin comes back from its snapshot on restart
        daemon.start()
        subscriber.drain()
        subscriber.resync()
        report = subscriber.sync_with(daemon.url)
        assert subscriber.blocks >= pin_blocks
        on_disk = subscriber.sync_disk(daemon.url)
        assert on_disk > 0 and subscriber.disk - subscriber.blocks  # evicted, still on disk
        completion(daemon.url, stem + [7])
        subscriber.sync_with(daemon.url)
        assert subscriber.topics == {f"kv@127.0.0.1:{daemon.port}@tiny-llama".encode()}
        assert not subscriber.removed & pin_blocks
    finally:
        subscriber.close()
        daemon.stop()
