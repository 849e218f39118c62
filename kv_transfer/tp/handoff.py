"""One request's KV hand-off between tensor-parallel workers, seen from rank 0: a handle made of parts.

A hand-off from a worker of TP ``p`` to one of TP ``d`` is one transfer per receiving rank, sent by the
sending ranks that hold its heads (``splitserve.kv_transfer.tp.parts``). Rank 0 of either worker moves some
parts itself (``SendHandle``/``ReceiveHandle``) and mirrors the others, which its follower ranks move, as
``RemotePart``s ended by those ranks' reports. The ``Handoff`` behaves as one ``TransferHandle``::

    every part DONE                      ─▶ DONE
    a part FAILED or CANCELLED           ─▶ the other live parts are ended (``end_part``), and once every
                                            part is terminal: that first part's state and error

It turns terminal only when every part is: nothing writes into (or reads from) the request's blocks on
any rank any more, so the owner may free them then, as with a single transfer. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from splitserve.kv_transfer.handles import TransferHandle, TransferState


class RemotePart(TransferHandle):
    """A part another rank of this worker moves; it ends when that rank reports it (``report``). Its deadline
    is the moving rank's: that rank's endpoint fails the part when it passes, and a rank that dies fails
    every part it held (``FollowerLink``)."""

    def __init__(self, transfer_id: str, rank: int) -> None:
        super().__init__(transfer_id, (), math.inf)
        self.rank = rank

    def report(self, state: TransferState, error: str = "", nbytes: int = 0) -> bool:
        """The moving rank says the part ended; False when it had ended already."""
        with self.lock:
            if self.terminal:
                return False
            if nbytes:
                self.nbytes = nbytes
                self.start()
        return self._settle(state, error)


class Handoff(TransferHandle):
    def __init__(
        self,
        transfer_id: str,
        parts: Sequence[TransferHandle],
        end_part: Callable[[TransferHandle, str], None],
    ) -> None:
        """``end_part(part, reason)`` cancels a live part (a local one at its endpoint, a remote one at its rank);
        the part reports its end as usual."""
        super().__init__(transfer_id, (), math.inf)
        if not parts:
            raise ValueError("parts: a hand-off has at least one part")
        self.parts = tuple(parts)
        self.commit = None  # a receiving rank 0: the commit its own part carried (the first token)
        self._end_part = end_part
        self._first_failure: TransferHandle | None = None
        for part in self.parts:
            part.on_terminal(self._part_ended)

    def end(self, reason: str) -> None:
        """Cancel every live part; the hand-off ends once they all have."""
        for part in self.parts:
            if not part.terminal:
                self._end_part(part, reason)

    # A hand-off's state follows its parts: ending it directly would let its owner free the blocks while a
    # part still writes into them (or reads from them).
    def start(self) -> bool:
        raise TypeError("a hand-off starts with its parts")

    def complete(self) -> bool:
        raise TypeError("a hand-off is done when its parts are")

    def fail(self, error: str) -> bool:
        raise TypeError("a hand-off fails with its parts; end(reason) cancels them")

    def cancel(self, reason: str) -> bool:
        raise TypeError("a hand-off is cancelled through its parts: end(reason)")

    def _part_ended(self, part: TransferHandle) -> None:
        with self.lock:
            failed_first = part.state is not TransferState.DONE and self._first_failure is None
            if failed_first:
                self._first_failure = part
            finished = all(p.terminal for p in self.parts)
        if failed_first and not finished:
            self.end(f"part {part.transfer_id} {part.state.value}: {part.error}")
        if finished:
            self._finish()

    def _finish(self) -> None:
        self.nbytes = sum(p.nbytes for p in self.parts)
        started = [p.started_at for p in self.parts if p.started_at is not None]
        self.started_at = min(started) if started else None
        self.commit = next((p.commit for p in self.parts if getattr(p, "commit", None) is not None), None)
        failure = self._first_failure
        if failure is None:
            self._settle(TransferState.DONE)
        else:
            self._settle(failure.state, f"{failure.transfer_id}: {failure.error}")
