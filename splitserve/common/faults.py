"""Fault injection, for tests: a deployment's plan, each process's share of it, and the hooks hot paths call.

    FaultPlan       the deployment config's ``faults:`` section (frozen)
      | for_worker(worker_id), for_router()
    Faults          one process's faults, carried by its config (frozen; pickled into a Ray actor)
      | arm(name)
    FaultHooks      live in the process: counts steps, sleeps the delays, ends the process at a kill point

A process without faults gets ``NO_FAULTS`` from ``arm``: every hook is a method call that returns.
A kill ends the process with ``os._exit``, as a crash would (no cleanup; the log is flushed first for
step and router kills); tests of the hooks inject ``exit`` and ``sleep`` instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from splitserve.common.validate import check_choice, check_range, check_ranges

FaultAction = Literal["pause", "drop", "die"]
Role = Literal["sender", "receiver"]
StepKind = Literal["prefill", "decode"]

# The log lines keep the loggers of the layers they speak for.
_worker_log = logging.getLogger("splitserve.worker")
_router_log = logging.getLogger("splitserve.router")
_kv_log = logging.getLogger("splitserve.kv_transfer")


@dataclass(frozen=True)
class FaultPoint:
    """Misbehave on purpose once a KV transfer has moved ``after_messages`` payload messages.

    - ``pause``: sleep ``seconds`` (a silent but live peer; the other side's deadline must fire);
    - ``drop``: abort the pair's group and control stream without a word (a broken connection);
    - ``die``: end the whole process at once (``os._exit``), as a crash or a lost node would.

    Counting is per transfer: the point fires in every transfer this endpoint moves whose id (a
    worker's transfer id is its request id) starts with ``request_id_prefix`` ("": every transfer),
    when that transfer's own count reaches ``after_messages``. So a long-lived deployment pauses each
    matching request, not only the first one it ever sees. The sender fires after posting that many
    of the transfer's messages and before posting the next (0: before the first), so a pause holds
    the rest of the transfer back and a transfer of ``after_messages`` messages or fewer is untouched;
    the receiver fires once that many have arrived.
    """

    role: Role
    action: FaultAction
    after_messages: int
    seconds: float = 0.0
    request_id_prefix: str = ""

    def __post_init__(self) -> None:
        check_choice(self, "role", ("sender", "receiver"), prefix="fault.")
        check_choice(self, "action", ("pause", "drop", "die"), prefix="fault.")
        check_ranges(self, ("after_messages", "seconds"), min=0, prefix="fault.")
        if not isinstance(self.request_id_prefix, str):
            raise ValueError(f"fault.request_id_prefix: must be a string, got {self.request_id_prefix!r}")

    def fires(self, role: Role, transfer_id: str, messages_done: int) -> bool:
        """Whether this point fires for ``transfer_id`` once it has moved ``messages_done`` messages."""
        return (
            self.role == role
            and self.after_messages == messages_done
            and transfer_id.startswith(self.request_id_prefix)
        )


# Where each kind of process can be killed (KillPoint.at).
KILL_PHASES = {
    "prefill": ("prefill", "transfer"),
    "decode": ("transfer", "decode"),
    "colocated": ("prefill", "decode"),
    "router": ("decode",),
}


@dataclass(frozen=True)
class KillPoint:
    """End one process at once (``os._exit``, as a crash would) at a chosen point, to reach each fault
    deterministically. ``target``: a worker id (``prefill-0``, ``decode-1``, ``colocated-0``) or
    ``router`` (the ``serve`` process). ``at``/``after``: a worker dies as its step number ``after + 1``
    of that phase starts (``prefill``, ``decode``), or after ``after`` KV payload messages of a transfer
    (``transfer``: the prefill worker as sender, the decode worker as receiver); the router dies instead of relaying
    more than ``after`` tokens in all (``decode``). A worker's kill point fires in its first incarnation only:
    the process Ray restarts runs clean."""

    target: str
    at: str
    after: int = 0
    rank: int = 0  # a tensor-parallel worker's rank that dies (0: the worker's own process)

    def __post_init__(self) -> None:
        role = "router" if self.target == "router" else self.target.rpartition("-")[0]
        if role not in KILL_PHASES or (role != "router" and not self.target.rpartition("-")[2].isdigit()):
            raise ValueError(f"target: {self.target!r} is not 'router' or a worker id such as 'decode-0'")
        if self.at not in KILL_PHASES[role]:
            raise ValueError(f"at: a {role} dies at {' or '.join(KILL_PHASES[role])}, not {self.at!r}")
        check_range(self, "after", min=0)
        check_range(self, "rank", min=0)
        if self.rank and self.target == "router":
            raise ValueError("rank: the router has no ranks")


@dataclass(frozen=True)
class FaultPlan:
    """The deployment config's ``faults:`` section: slow or break things on purpose (tests only)."""

    prefill_delay_s: float = 0.0  # prefill workers: sleep before every step that computes prompt tokens
    decode_step_delay_s: float = 0.0  # decode and colocated workers: sleep after every step
    transfer: tuple[FaultPoint, ...] = ()  # every worker's KV transfer points
    kill: tuple[KillPoint, ...] = ()

    def __post_init__(self) -> None:
        check_ranges(self, ("prefill_delay_s", "decode_step_delay_s"), min=0)

    def for_worker(self, worker_id: str, rank: int = 0) -> Faults:
        """The faults of the worker with this id (``prefill-0``), or of one rank of it: its phase's delay, its
        kill point, and the transfer points (a kill ``at: transfer`` becomes a ``die`` point on its side of
        the transfer). A rank other than 0 delays nothing: it runs rank 0's steps."""
        role = worker_id.rpartition("-")[0]
        kills = [k for k in self.kill if k.target == worker_id and k.rank == rank]
        step = next((k for k in kills if k.at != "transfer"), None)
        side: Role = "sender" if role == "prefill" else "receiver"
        return Faults(
            prefill_delay_s=self.prefill_delay_s if role == "prefill" and not rank else 0.0,
            decode_step_delay_s=0.0 if role == "prefill" or rank else self.decode_step_delay_s,
            die_at=step.at if step else "",
            die_after=step.after if step else 0,
            transfer=self.transfer + tuple(FaultPoint(side, "die", k.after) for k in kills if k.at == "transfer"),
        )

    def for_router(self) -> Faults:
        return Faults(die_after_tokens=next((k.after for k in self.kill if k.target == "router"), -1))


@dataclass(frozen=True)
class Faults:
    """One process's faults, as its config carries them; ``arm`` gives the hooks that apply them."""

    prefill_delay_s: float = 0.0  # sleep before every step that computes prompt tokens
    decode_step_delay_s: float = 0.0  # sleep after every step
    # The process exits at once as its step number ``die_after + 1`` of this kind starts: "prefill" (a step
    # computing prompt tokens) or "decode". "": never.
    die_at: str = ""
    die_after: int = 0
    transfer: tuple[FaultPoint, ...] = ()  # KV transfer points (the process's sender or receiver)
    die_after_tokens: int = -1  # the router exits instead of relaying more tokens than this in all; -1: never

    def __post_init__(self) -> None:
        check_ranges(self, ("prefill_delay_s", "decode_step_delay_s", "die_after"), min=0, prefix="faults.")
        check_choice(self, "die_at", ("", "prefill", "decode"), prefix="faults.")
        check_range(self, "die_after_tokens", min=-1, prefix="faults.")

    def restarted(self) -> Faults:
        """These faults in a process Ray restarted: the points that end the process fire in its first
        incarnation only, so the new one runs clean (the delays and the other transfer points stay)."""
        return replace(self, die_at="", transfer=tuple(f for f in self.transfer if f.action != "die"))

    def arm(
        self,
        name: str = "",
        exit: Callable[[int], object] | None = None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> FaultHooks:
        """The hooks of this process (``name`` as its log lines call it, e.g. "decode worker decode-0");
        ``NO_FAULTS`` when nothing is set. ``exit``: instead of ending the process (tests)."""
        if self == Faults():
            return NO_FAULTS
        return FaultHooks(self, name, exit, sleep)


class FaultHooks:
    """The calls hot paths make: ``step`` as a worker step starts, ``step_done`` as it ends,
    ``tokens_relayed`` as the router passes tokens on, ``transfer`` as a KV transfer moves a message."""

    def __init__(
        self, faults: Faults, name: str, exit: Callable[[int], object] | None, sleep: Callable[[float], object]
    ) -> None:
        self.faults, self.name = faults, name
        self._exit, self._sleep = exit, sleep
        self._steps = {"prefill": 0, "decode": 0}  # steps of each kind started, counted for the kill point

    def step(self, kind: StepKind) -> None:
        """A step of this kind starts: die here at the kill point; a prefill step first sleeps the delay."""
        f = self.faults
        if f.die_at == kind:
            if self._steps[kind] == f.die_after:
                _worker_log.error("%s: dying at %s step %d (fault point)", self.name, kind, f.die_after + 1)
                self._die(1, flush_log=True)
                return
            self._steps[kind] += 1
        if kind == "prefill" and f.prefill_delay_s:
            self._sleep(f.prefill_delay_s)

    def step_done(self) -> None:
        """A step has ended (its tokens are out): sleep the decode delay."""
        if self.faults.decode_step_delay_s:
            self._sleep(self.faults.decode_step_delay_s)

    def tokens_relayed(self, total: int) -> None:
        """The router has relayed ``total`` tokens in all: past its kill point it dies before sending them."""
        if 0 <= self.faults.die_after_tokens < total:
            _router_log.error("router: dying after %d tokens relayed (fault point)", total)
            self._die(1, flush_log=True)

    def transfer(self, role: Role, transfer_id: str, messages_done: int) -> bool:
        """A transfer has moved ``messages_done`` messages: pause or die at a point that fires here.
        Returns True when its connection must drop (the endpoint breaks its pairs)."""
        fault = next((f for f in self.faults.transfer if f.fires(role, transfer_id, messages_done)), None)
        if fault is None:
            return False
        _kv_log.warning(
            "kv %s fault point: %s after %d messages of transfer %s", role, fault.action, messages_done, transfer_id
        )
        if fault.action == "die":
            self._die(17, flush_log=False)
        elif fault.action == "pause":
            self._sleep(fault.seconds)
        return fault.action == "drop"

    def _die(self, code: int, flush_log: bool) -> None:
        if self._exit is not None:
            self._exit(code)
            return
        if flush_log:
            logging.shutdown()
        os._exit(code)


class NoFaults(FaultHooks):
    """The hooks of a process without faults: each one returns at once."""

    def __init__(self) -> None:
        super().__init__(Faults(), "", None, time.sleep)

    def step(self, kind: StepKind) -> None:
        return

    def step_done(self) -> None:
        return

    def tokens_relayed(self, total: int) -> None:
        return

    def transfer(self, role: Role, transfer_id: str, messages_done: int) -> bool:
        return False


NO_FAULTS = NoFaults()
