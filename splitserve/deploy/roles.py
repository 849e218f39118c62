"""Which worker class serves each role: the one table ``splitserve serve`` reads (launch.py's Ray actor).

It sits in the launcher layer because it names both worker packages, which may not import each other
(docs/architecture.md). ``python -m splitserve.prefill_worker`` and ``python -m splitserve.decode_worker``
each pass their own class to ``splitserve.worker_common.cli.main`` instead, for the same reason.
Importing this module imports the workers, and so torch: import it where a worker is about to start.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from splitserve.colocated_worker.worker import ColocatedWorker
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.worker_common.base import WorkerBase

WORKER_CLASSES: Mapping[str, type[WorkerBase]] = MappingProxyType(
    {"prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker}
)


def worker_class(role: str) -> type[WorkerBase]:
    """The class that serves ``role``; a role not in the table is an error that names it."""
    try:
        return WORKER_CLASSES[role]
    except KeyError:
        raise ValueError(f"role: {role!r} is not one of {', '.join(map(repr, WORKER_CLASSES))}") from None
