"""The ``PrefillWorker`` gRPC service, served by the prefill and the colocated worker alike: a thin edge
that turns calls into jobs and a job's events into the call's messages (``stream_events``)."""

from __future__ import annotations

from typing import Protocol

from splitserve.common.errors import ServingError
from splitserve.observability.logs import request_context
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.status import abort
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.worker_common.base import stream_events
from splitserve.worker_common.prefill_edge.cache_events import CacheEventFeed
from splitserve.worker_common.prefill_edge.jobs import PrefillJob


class PrefillProtocol(Protocol):
    """What the service needs of a worker behind it."""

    cache_events: CacheEventFeed

    def accept(self, message: wpb.PrefillRequest) -> PrefillJob: ...

    def cancel(self, job: PrefillJob) -> None: ...

    def status_message(self) -> pb.WorkerStatus: ...


class PrefillServicer(wpb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillProtocol) -> None:
        self.worker = worker

    def Prefill(self, request, context):  # noqa: N802
        with request_context(request.request_id):
            try:
                job = self.worker.accept(request)
            except ServingError as e:
                abort(context, e)
            if not context.add_callback(lambda: self.worker.cancel(job)):  # the call ended already
                self.worker.cancel(job)
                return
            yield from stream_events(job.events, context)

    def Status(self, request, context):  # noqa: N802
        return self.worker.status_message()

    def CacheEvents(self, request, context):  # noqa: N802
        feed = self.worker.cache_events
        events, snapshot = feed.subscribe()
        context.add_callback(lambda: feed.unsubscribe(events))
        yield feed.snapshot_message(snapshot)
        yield from stream_events(events, context)
