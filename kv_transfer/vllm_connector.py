"""splitserve's KV transfer as a vLLM KV connector (``KVConnectorBase_V1``), for the disaggregated workers of
the vllm engine backend (docs/kv_transfer.md, "vLLM workers").

vLLM loads it from its kv-transfer config (``kv_connector="SplitserveConnector"``,
``kv_connector_module_path="splitserve.kv_transfer.vllm_connector"``, ``kv_role`` kv_producer on a prefill worker,
kv_consumer on a decode worker); ``worker_common/vllm_engine.py`` sets that up. The KV itself moves as it does
between splitserve engines: the prefill worker's ``KVSender`` reads vLLM's paged blocks by block id and the
decode worker's ``KVReceiver`` writes them into the blocks vLLM's scheduler leased, over the same pair groups
(gloo on CPU, NCCL between GPUs), descriptors, deadlines and layout fingerprint. This connector is the part that
tells vLLM's scheduler about it:

* decode (kv_consumer): a lease enters vLLM as a request whose ``kv_transfer_params`` name the tokens whose KV
  will arrive (``EXTERNAL_TOKENS``). ``get_num_new_matched_tokens`` answers them, to be loaded asynchronously;
  ``update_state_after_alloc`` records the blocks vLLM allocated, which the worker hands its receiver; once the
  KV has landed the worker marks it received and ``get_finished`` reports it, so the scheduler computes the
  first token's KV and samples the next one. A lease given up before its KV lands is reported received too,
  after vLLM aborted it, so that vLLM frees its blocks at once (vLLM keeps the blocks of a request aborted while
  it waits for remote KV until the connector says the load is over).
* prefill (kv_producer): a request that hands off at its first token (``HAND_OFF``) keeps its blocks when vLLM
  finishes it (``request_finished`` returns True), while the sender reads them; the worker marks it sent when its
  transfer ends (done, failed or cancelled) and ``get_finished`` reports it, so vLLM frees the blocks then, not
  at a timeout. An aborted request keeps nothing.

Both vLLM instances of the connector (the scheduler's and the worker's) live in the worker's one process (the
engine core in-process, the single-process executor), so they share one ``ConnectorLink`` per engine, found by
the kv-transfer config's ``engine_id``. vLLM calls ``save_kv_layer`` after each attention layer of the forward
has written its KV: the link tells the worker's KV sender, which streams the prompt's finished layers to the decode
worker while the later ones compute (``ConnectorLink.watch_layers``); loads need no per-layer hook (the KV has
landed before the request is scheduled).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

# kv_transfer_params keys this connector reads.
EXTERNAL_TOKENS = "splitserve_external_tokens"  # decode: tokens whose KV the prefill worker sends
HAND_OFF = "splitserve_hand_off"  # prefill: keep the blocks at the first token, for the sender


class ConnectorLink:
    """What the worker and the two connector instances of one engine share (all methods thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._admitted: dict[str, threading.Event] = {}  # decode: lease -> set once vLLM allocated its blocks
        self._tables: dict[str, list[int]] = {}
        self._held: dict[str, list[int]] = {}  # prefill: finished requests whose blocks the sender still reads
        self._received: set[str] = set()  # to report through get_finished
        self._sent: set[str] = set()
        self._on_layer: Callable[[int], None] | None = None  # prefill: this step's layer hook (the forward's thread)
        self._layers_saved = 0

    # ---- the forward's layers (prefill) ---------------------------------------------------------

    def watch_layers(self, on_layer: Callable[[int], None] | None) -> None:
        """Call ``on_layer(n)`` as the next forward's attention layers have written their KV (n layers so
        far), from the forward's thread; None stops watching. The KV sender streams those layers meanwhile."""
        self._on_layer, self._layers_saved = on_layer, 0

    def layer_saved(self) -> None:
        if self._on_layer is not None:
            self._layers_saved += 1
            self._on_layer(self._layers_saved)

    @property
    def layers_saved(self) -> int:
        return self._layers_saved

    # ---- decode ---------------------------------------------------------------------------------

    def expect_lease(self, request_id: str) -> None:
        with self._lock:
            self._admitted[request_id] = threading.Event()

    def leased(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            event = self._admitted.get(request_id)
            if event is None or event.is_set():
                return
            self._tables[request_id] = list(block_ids)
            event.set()

    def wait_lease(self, request_id: str, timeout_s: float) -> list[int] | None:
        """The lease's blocks once vLLM allocated them; None if not within ``timeout_s`` (or given up)."""
        with self._lock:
            event = self._admitted.get(request_id)
        if event is None or not event.wait(timeout_s):
            return None
        with self._lock:
            table = self._tables.get(request_id)
            return list(table) if table is not None else None

    def is_admitted(self, request_id: str) -> bool:
        with self._lock:
            event = self._admitted.get(request_id)
            return event is not None and event.is_set()

    def end_lease(self, request_id: str, report: bool) -> None:
        """The lease is over (its KV landed, or it was given up): report it received if vLLM holds its blocks."""
        with self._lock:
            admitted = self._admitted.pop(request_id, None)
            self._tables.pop(request_id, None)
            if report and admitted is not None and admitted.is_set():
                self._received.add(request_id)

    # ---- prefill --------------------------------------------------------------------------------

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._held[request_id] = list(block_ids)

    def held(self, request_id: str) -> list[int] | None:
        with self._lock:
            table = self._held.get(request_id)
            return list(table) if table is not None else None

    def release(self, request_id: str) -> bool:
        """The sender is done with a held request's blocks: report it sent (False if none were held)."""
        with self._lock:
            if self._held.pop(request_id, None) is None:
                return False
            self._sent.add(request_id)
            return True

    # ---- both -----------------------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether get_finished has something to report (the worker steps vLLM once to deliver it)."""
        with self._lock:
            return bool(self._received or self._sent)

    def take_finished(self) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sent, received = self._sent, self._received
            self._sent, self._received = set(), set()
        return sent or None, received or None

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)


_LINKS: dict[str, ConnectorLink] = {}
_LINKS_LOCK = threading.Lock()


def link_for(engine_id: str) -> ConnectorLink:
    """The link of the engine with this kv-transfer ``engine_id`` (made on first use)."""
    with _LINKS_LOCK:
        return _LINKS.setdefault(engine_id, ConnectorLink())


def drop_link(engine_id: str) -> None:
    with _LINKS_LOCK:
        _LINKS.pop(engine_id, None)


class SplitserveMetadata(KVConnectorMetadata):
    """Nothing travels from the scheduler to the worker side: the link carries it."""


class SplitserveConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.link = link_for(self._kv_transfer_config.engine_id)

    # ---- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        external = (request.kv_transfer_params or {}).get(EXTERNAL_TOKENS)
        if not external:
            return 0, False
        count = max(0, int(external) - num_computed_tokens)
        return count, count > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.link.leased(request.request_id, blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return SplitserveMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if not (request.kv_transfer_params or {}).get(HAND_OFF) or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        self.link.hold(request.request_id, block_ids)
        return True, None

    # ---- worker side ----------------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # the worker's KVReceiver wrote the KV into the leased blocks before the request was promoted

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.link.layer_saved()  # this layer's KV is in the cache: the worker's KVSender may send it now

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.link.take_finished()
