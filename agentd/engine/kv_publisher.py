"""vLLM's KV-event stream from the block pool's real changes, for routers that score replicas by
the blocks they hold (llm-d's precise prefix-cache scorer, Dynamo's KV router, SMG's event mode).

The wire is vLLM's: a ZMQ PUB socket sends ``(topic, seq, payload)`` frames, ``seq`` an 8-byte
big-endian counter from 0 and ``payload`` a msgpack ``EventBatch`` ``[ts, events, dp_rank]`` whose
events are tag-first arrays: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``. The pool's events carry medium ``CPU`` (``GPU`` on CUDA); the disk tier
under it reports its own blocks with medium ``DISK``, hashes only (the pool's event for the same
hash carried its tokens and parent), those it holds at start right after the ``AllBlocksCleared``.
Block hashes are agentd's own 16-byte content hashes (msgpack bin). A
ROUTER socket (``replay_endpoint``) answers a subscriber that sends an 8-byte start seq with every
buffered batch from there, as ``(seq, payload)`` frames, then ``(-1, b"")``.

Invariants: the engine thread only appends to a queue (``stored``/``removed``: the pool's sink);
one publisher thread encodes and sends. The first batch (seq 0) is ``AllBlocksCleared``: a
restarted replica's pool is empty, so a subscriber that replays from 0 starts from nothing.
pyzmq is imported only when ``--kv-events`` is given (``pip install agentd[cluster]``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from agentd.cache import NULL_KV_EVENTS, BlockHash, KVEventSink
from agentd.config import KVEventsConfig

logger = logging.getLogger("agentd")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- the wire: vLLM's structs, array-like with the tag first --------------------------------
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class WireBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class WireBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class WireAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


def decode_batch(payload: bytes) -> WireEventBatch:
    """A payload as a subscriber reads it."""
    return msgspec.msgpack.decode(payload, type=WireEventBatch)


# --- the publisher ---------------------------------------------------------------------------
class KVEventPublisher:
    """The pool's sink: events queued on the engine thread, sent by a thread of their own."""

    def __init__(self, config: KVEventsConfig, model_name: str, block_size: int,
                 medium: str) -> None:
        import zmq  # the cluster extra; imported only when events are asked for

        self.config = config
        self.topic = config.topic(model_name).encode()
        self.block_size = block_size
        self.medium = medium
        self._queue: queue.SimpleQueue[WireEvent | None] = queue.SimpleQueue()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_batches)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._queue.put(WireAllBlocksCleared())
        self._thread = threading.Thread(target=self._run, name="agentd-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (topic %s)%s", config.endpoint,
                    self.topic.decode(), f", replay on {config.replay_endpoint}"
                    if config.replay_endpoint else "")

    # the pool's sink (engine thread): queue and return
    def stored(self, block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
               token_ids: Sequence[int]) -> None:
        self._queue.put(WireBlockStored(list(block_hashes), parent_block_hash, list(token_ids),
                                        self.block_size, None, self.medium, None))

    def removed(self, block_hash: BlockHash) -> None:
        self._queue.put(WireBlockRemoved([block_hash], self.medium))

    # a tier under the pool (the disk's writer and loader threads): its own medium, and only
    # the hashes (the pool's event for the same hash carried its tokens and parent)
    def tier_stored(self, medium: str, block_hashes: Sequence[BlockHash]) -> None:
        self._queue.put(WireBlockStored(list(block_hashes), None, [], self.block_size, None,
                                        medium, None))

    def tier_removed(self, medium: str, block_hashes: Sequence[BlockHash]) -> None:
        self._queue.put(WireBlockRemoved(list(block_hashes), medium))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    # the publisher thread
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                self._serve_replays()
                try:
                    first = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                events, done = self._batch(first)
                if events:
                    payload = encoder.encode(WireEventBatch(time.time(), events))
                    self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    seq += 1
                if done:
                    return
        except Exception:  # never take the engine down with us: stop publishing, say so
            logger.exception("the KV-event publisher failed; no more KV events are sent")
        finally:
            self._pub.close(linger=500)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._context.term()

    def _batch(self, first: WireEvent | None, limit: int = 1024) -> tuple[list[Any], bool]:
        """``first`` and whatever else is queued now (up to ``limit``); True once closed."""
        events: list[Any] = []
        item = first
        while True:
            if item is None:
                return events, True
            events.append(item)
            if len(events) >= limit:
                return events, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return events, False

    def _serve_replays(self) -> None:
        import zmq

        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignoring a malformed KV-event replay request")
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload),
                                          flags=zmq.NOBLOCK)
            replay.send_multipart((client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)


def open_kv_events(config: KVEventsConfig | None, model_name: str, block_size: int,
                   device_type: str) -> KVEventSink:
    """The pool's sink: a publisher when ``config`` asks for one, else the null sink."""
    if config is None:
        return NULL_KV_EVENTS
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("--kv-events needs pyzmq: pip install 'agentd[cluster]'") from exc
    return KVEventPublisher(config, model_name, block_size,
                            "GPU" if device_type == "cuda" else "CPU")
