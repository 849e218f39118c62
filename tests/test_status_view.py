"""`splitserve status`'s table: the summary line, one aligned row per worker in id order, usage."""

from __future__ import annotations

from splitserve.client.status_view import COLUMNS, format_status, status_json
from splitserve.v1 import splitserve_pb2 as pb


def make_status(workers=(), **fields) -> pb.GetStatusResponse:
    return pb.GetStatusResponse(workers=list(workers), model="tiny", **fields)


def make_worker(worker_id: str, healthy: bool = True, **fields) -> pb.WorkerStatus:
    return pb.WorkerStatus(
        worker_id=worker_id,
        role=worker_id.split("-")[0],
        node_id="ab" * 20,
        healthy=healthy,
        address=f"10.0.0.{len(worker_id)}:7000",
        **fields,
    )


def test_table_rows_summary_and_alignment():
    status = make_status(
        [
            make_worker("prefill-10", kv_blocks_total=1000, kv_blocks_in_use=250, kv_blocks_cached=40, running=3),
            make_worker("prefill-2", metrics_address="10.0.0.9:9100", cpus="0-3,8", threads=5, tensor_parallel_size=4),
            make_worker("decode-0", healthy=False, waiting=12),
        ],
        queued_requests=5,
        running_requests=7,
        metrics_address="127.0.0.1:9400",
    )
    lines = format_status(status, "127.0.0.1:50051").splitlines()
    assert lines[0] == (
        "router 127.0.0.1:50051  model tiny  queued 5  running 7  workers 2/3 healthy  metrics 127.0.0.1:9400"
    )
    assert lines[1].split() == [w for c in COLUMNS for w in c.split()]
    assert [line.split()[0] for line in lines[2:]] == ["decode-0", "prefill-2", "prefill-10"]
    decode, small, big = (line.split() for line in lines[2:])
    assert decode[3] == "DOWN" and decode[5] == "12" and decode[2] == "ab" * 6 and decode[-1] == "-"
    assert big[6:8] == ["250/1000", "(25%)"] and big[8] == "40" and big[4] == "3"
    assert small[-1] == "10.0.0.9:9100" and small[9:12] == ["0-3,8", "5", "4"] and big[9:12] == ["-", "0", "1"]
    for column, prefix in [
        ("ROLE", ("decode", "prefill")),
        ("CPUS", ("-", "0-3,8")),
        ("ADDRESS", ("10.0.0.",)),
        ("METRICS", ("-", "10.0")),
    ]:
        offset = lines[1].index(column)  # every cell starts under its header
        assert all(line[offset:].startswith(prefix) for line in lines[2:]), column
    running = lines[1].index("RUN") + len("RUN")  # numbers end under theirs
    assert [line[:running].split()[-1] for line in lines[2:]] == ["0", "0", "3"]


def test_no_workers_and_json_keeps_every_field():
    lines = format_status(make_status(), "h:1").splitlines()
    assert "workers 0/0 healthy" in lines[0] and "metrics off" in lines[0] and lines[-1] == "(no workers)"
    data = status_json(make_status([make_worker("decode-0")]))
    assert data["metrics_address"] == "" and data["workers"][0]["metrics_address"] == ""
    assert data["workers"][0]["kv_blocks_in_use"] == 0 and data["model"] == "tiny"
    assert (data["workers"][0]["cpus"], data["workers"][0]["threads"]) == ("", 0)


def test_decode_graphs_line_only_for_workers_that_captured():
    graphs = "7 graphs (batch 1-64), captured in 2.10 s, 120.0 MiB"
    status = make_status([make_worker("decode-0", decode_graphs=graphs), make_worker("prefill-0")])
    lines = format_status(status, "h:1").splitlines()
    assert lines[-1] == f"decode-0 decode graphs: {graphs}"
    assert [line.split()[0] for line in lines[2:4]] == ["decode-0", "prefill-0"] and len(lines) == 5
    assert status_json(status)["workers"][1]["decode_graphs"] == ""


def test_planner_and_pending_workers_lines():
    status = make_status(
        [make_worker("prefill-0")],
        planner="prefill 1 -> 2 (applied)",
        pending_workers=["prefill-1: splitserve_prefill 1"],
    )
    lines = format_status(status, "127.0.0.1:50051").splitlines()
    assert lines[-2:] == [
        "planner: prefill 1 -> 2 (applied)",
        "pending: prefill-1: splitserve_prefill 1 (waits for resources no node has free)",
    ]
    assert status_json(status)["pending_workers"] == ["prefill-1: splitserve_prefill 1"]


def test_linear_kernels_line_for_workers_that_report_them():
    kernels = "bfloat16; 1152x896 bfloat16 +bias packed, 896x896 bfloat16 upcast"
    status = make_status([make_worker("decode-0", linear_kernels=kernels), make_worker("prefill-0")])
    text = format_status(status, "127.0.0.1:50051")
    assert f"decode-0 linear kernels: {kernels}" in text.splitlines()
    assert "prefill-0 linear kernels" not in text
    assert status_json(status)["workers"][0]["linear_kernels"] == kernels
