"""Fakes of what a pair runs over: a 2-rank group with NCCL's semantics (tags ignored: one FIFO per
direction, completion polled through ``is_completed``), so the pair logic written for NCCL runs and is
tested without a GPU. The control stream in memory instead of over gRPC is ``splitserve.kv_transfer.local``'s."""

from __future__ import annotations

import queue
import threading
from collections import defaultdict

import torch


class FakeWork:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: str | None = None

    def finish(self, error: str | None = None) -> None:
        self.error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        if self.error:
            raise RuntimeError(self.error)
        return True


class _Direction:
    """Matches sends with receives strictly in posting order, like NCCL on one communicator."""

    def __init__(self, frozen: bool) -> None:
        self.sends: queue.Queue = queue.Queue()
        self.recvs: queue.Queue = queue.Queue()
        if not frozen:
            threading.Thread(target=self._match, daemon=True).start()

    def _match(self) -> None:
        while True:
            src, send_work = self.sends.get()
            dst, recv_work = self.recvs.get()
            if src.numel() * src.element_size() != dst.numel() * dst.element_size():
                send_work.finish("size mismatch")
                recv_work.finish("size mismatch")
                continue
            dst.view(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
            send_work.finish()
            recv_work.finish()


class FakeGroup:
    def __init__(self, link: dict, rank: int) -> None:
        self.link, self.rank, self.aborted = link, rank, False

    def send(self, tensors, peer, tag):
        work = FakeWork()
        self.link[(self.rank, peer)].sends.put((tensors[0], work))
        return work

    def recv(self, tensors, peer, tag):
        work = FakeWork()
        self.link[(peer, self.rank)].recvs.put((tensors[0], work))
        return work

    def abort(self) -> None:
        self.aborted = True


class FakeFabric:
    """Hands out connected FakeGroups by store prefix; ``frozen=True`` makes a peer that never answers."""

    def __init__(self, frozen: bool = False) -> None:
        self.frozen = frozen
        self._links: dict = defaultdict(lambda: {(0, 1): _Direction(self.frozen), (1, 0): _Direction(self.frozen)})
        self._lock = threading.Lock()

    def factory(self, backend, store, prefix, rank, host, timeout_s, device):
        from splitserve.kv_transfer.comm import GroupCommunicator

        with self._lock:
            link = self._links[prefix]
        return GroupCommunicator(FakeGroup(link, rank), rank, "nccl", device)
