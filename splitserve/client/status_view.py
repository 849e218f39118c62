"""``splitserve status`` as a person reads it: a summary line, then one row per worker.

    router 127.0.0.1:50051  model tiny  queued 0  running 2  workers 2/2 healthy  metrics 127.0.0.1:9400
    WORKER     ROLE     NODE          HEALTH  RUN  WAIT  KV USED          CACHED  CPUS  THREADS  TP  ADDRESS          METRICS
    prefill-0  prefill  4c1d9a0e21f3  ok        0     0  0/2048 (0%)          12  0           1   2  127.0.0.1:41023  127.0.0.1:38811
    decode-0   decode   4c1d9a0e21f3  ok        2     0  24/2048 (1%)          0  1           1   1  127.0.0.1:40117  127.0.0.1:35291

CPUS is the set the worker's process may run on (its ``cpus`` when pinned), THREADS its torch threads, TP
the ranks (processes, one per device) it spans: its rank 0's figures are the worker's.

then, for each worker that captured CUDA graphs of its decode step (``decode_graphs``), one line:
``decode-0 decode graphs: 7 graphs (batch 1-64), captured in 2.10 s, 120.0 MiB``; and for each worker that
reports them (``linear_kernels``), the dtype its model computes in and each linear shape's kernel:
``decode-0 linear kernels: bfloat16; 1152x896 bfloat16 +bias packed, 896x896 bfloat16 packed, ...``.

``--json`` prints the ``GetStatusResponse`` itself (proto field names, every field).
"""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from splitserve.v1 import splitserve_pb2 as pb

COLUMNS = (
    "WORKER",
    "ROLE",
    "NODE",
    "HEALTH",
    "RUN",
    "WAIT",
    "KV USED",
    "CACHED",
    "CPUS",
    "THREADS",
    "TP",
    "ADDRESS",
    "METRICS",
)
_NUMERIC = {"RUN", "WAIT", "CACHED", "THREADS", "TP"}


def status_json(status: pb.GetStatusResponse) -> dict:
    return MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _kv_used(w: pb.WorkerStatus) -> str:
    percent = 100 * w.kv_blocks_in_use / w.kv_blocks_total if w.kv_blocks_total else 0.0
    return f"{w.kv_blocks_in_use}/{w.kv_blocks_total} ({percent:.0f}%)"


def format_status(status: pb.GetStatusResponse, address: str) -> str:
    healthy = sum(w.healthy for w in status.workers)
    summary = (
        f"router {address}  model {status.model}  queued {status.queued_requests}  running "
        f"{status.running_requests}  workers {healthy}/{len(status.workers)} healthy  "
        f"metrics {status.metrics_address or 'off'}"
    )
    workers = sorted(status.workers, key=lambda w: (w.role, _id_key(w.worker_id)))
    rows = [
        (
            w.worker_id,
            w.role,
            w.node_id[:12],
            "ok" if w.healthy else "DOWN",
            str(w.running),
            str(w.waiting),
            _kv_used(w),
            str(w.kv_blocks_cached),
            w.cpus or "-",
            str(w.threads),
            str(w.tensor_parallel_size or 1),
            w.address,
            w.metrics_address or "-",
        )
        for w in workers
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = [summary]
    for row in (COLUMNS, *rows):
        cells = [cell.rjust(w) if col in _NUMERIC else cell.ljust(w) for col, cell, w in zip(COLUMNS, row, widths)]
        lines.append("  ".join(cells).rstrip())
    if not rows:
        lines.append("(no workers)")
    lines.extend(f"{w.worker_id} decode graphs: {w.decode_graphs}" for w in workers if w.decode_graphs)
    lines.extend(f"{w.worker_id} linear kernels: {w.linear_kernels}" for w in workers if w.linear_kernels)
    if status.planner:
        lines.append(f"planner: {status.planner}")
    lines.extend(f"pending: {w} (waits for resources no node has free)" for w in status.pending_workers)
    return "\n".join(lines)


def _id_key(worker_id: str) -> tuple[str, int]:
    """prefill-2 before prefill-10."""
    name, _, number = worker_id.rpartition("-")
    return (name, int(number)) if number.isdigit() else (worker_id, -1)
