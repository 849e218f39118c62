"""The messages inside a worker process: commands to the loop thread, and events to a request's call.

Each kind is one small frozen dataclass, and each queue carries one closed set of them (``Command``,
``Event``), dispatched with ``match`` whose last case raises: a message nobody handles is a bug to
surface, never a default action. Protobuf stays at the edges: an ``Emit`` carries the protobuf event
its call sends, and only ``stream_events`` (the servicer side) turns events into messages or a status.

Commands, from any thread to the loop (``WorkerBase.submit``)::

    Add(job)     a prefill or colocated request was accepted, or a decode worker's that it prefills
                 itself (conditional disaggregation): schedule it
    Admit(job)   a decode request's KV has landed: join the batch
    Cancel(job)  the router's call ended: drop the job, in whatever phase it is
    Drain()      the router asked this worker to drain (``WorkerBase.draining`` is already set)

Events, from the loop (or a transfer callback) to a request's gRPC call; a queue ends with exactly
one ``End`` or ``Fail``::

    Emit(message)* ─▶ End()          the call returns normally
                  └─▶ Fail(error)    the call ends with the error's gRPC status
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from splitserve.common.errors import ServingError


# ---- commands to the loop thread -------------------------------------------------------------------
# ``job`` is the worker's own record of the request (PrefillJob, DecodeJob); commands name it, not its
# id, so a late command can never touch a newer request that reuses the id.


@dataclass(frozen=True)
class Add:
    job: Any


@dataclass(frozen=True)
class Admit:
    job: Any


@dataclass(frozen=True)
class Cancel:
    job: Any


@dataclass(frozen=True)
class Drain:
    pass


Command = Add | Admit | Cancel | Drain


def unknown_command(command: object) -> TypeError:
    """The error a loop raises for a command it has no case for."""
    return TypeError(f"unknown worker command {command!r}")


# ---- events to a request's call --------------------------------------------------------------------


@dataclass(frozen=True)
class Emit:
    message: Message  # the protobuf event the call sends (PrefillEvent, DecodeEvent, CacheEvent)


@dataclass(frozen=True)
class End:
    pass


@dataclass(frozen=True)
class Fail:
    error: ServingError


Event = Emit | End | Fail


def make_event_queue() -> queue.Queue[Event]:
    return queue.Queue()


def unknown_event(event: object) -> TypeError:
    return TypeError(f"unknown worker event {event!r}")
