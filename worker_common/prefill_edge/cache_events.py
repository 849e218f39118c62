"""The prefix-cache event feed for the router (``CacheEvents``): a snapshot of the block hashes held,
then every block stored or removed, so the router can route by prefix. Shared by the prefill and the
colocated worker, both of which keep a prefix cache."""

from __future__ import annotations

import queue
import threading

from splitserve.rpc import workers_pb2 as wpb
from splitserve.worker_common.engine_api import Engine
from splitserve.worker_common.messages import Emit, End, Event

_KINDS = {"stored": wpb.CacheEvent.STORED, "removed": wpb.CacheEvent.REMOVED}


class CacheEventFeed:
    def __init__(self, engine: Engine, lock: threading.RLock) -> None:
        self.engine, self.lock, self.block_size = engine, lock, engine.prefix_block_size
        self._subscribers: list[queue.Queue[Event]] = []

    def subscribe(self) -> tuple[queue.Queue[Event], list[int]]:
        """A queue of future cache events, and the snapshot of hashes held now (taken atomically)."""
        events: queue.Queue[Event] = queue.Queue()
        with self.lock:
            self.publish()
            snapshot = self.engine.cached_hashes()
            self._subscribers.append(events)
        return events, snapshot

    def unsubscribe(self, events: queue.Queue[Event]) -> None:
        with self.lock:
            if events in self._subscribers:
                self._subscribers.remove(events)
        events.put(End())

    def publish(self) -> None:
        """Hand the block events recorded since the last call to every subscriber."""
        with self.lock:
            for event in self.engine.take_block_events():
                message = wpb.CacheEvent(
                    kind=_KINDS[event.kind], block_hashes=list(event.block_hashes), block_size=self.block_size
                )
                for subscriber in self._subscribers:
                    subscriber.put(Emit(message))

    def snapshot_message(self, snapshot: list[int]) -> wpb.CacheEvent:
        return wpb.CacheEvent(kind=wpb.CacheEvent.SNAPSHOT, block_hashes=snapshot, block_size=self.block_size)
