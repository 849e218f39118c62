"""``splitserve bench`` end to end: short runs against a served tiny model (one deployment for the
module), through the command line in its own process, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.bench.mooncake import SAMPLE_TRACE, read_trace
from splitserve.client.grpc_client import Client
from tests.serving.conftest import start_deployment

RESULT_KEYS = (
    "date",
    "backend",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "tpots",
    "e2els",
    "errors",
    "client_queue_times",
    "mean_server_transfer_ms",
    "mean_client_queue_ms",
    "p99_client_queue_ms",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p95", "p99")),
)


@pytest.fixture(scope="module")
def deployment(ray_session, serving_model):
    # openai_port: the --backend openai test; metrics_port: the table of where the time went
    deployment = start_deployment(serving_model, openai_port=0, metrics_port=0)
    yield deployment
    deployment.stop()


def run_bench(*args: str, timeout_s: float = 60, returncode: int = 0) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "bench", *args, "--no-progress", "--request-timeout", str(timeout_s)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == returncode, out.stderr
    return out


def assert_all_served(result: dict, num_prompts: int) -> None:
    assert result["failed"] == 0 and result["failures"] == {} and set(result["errors"]) == {""}
    assert result["completed"] == result["num_prompts"] == num_prompts
    assert result["output_lens"] == result["expected_output_lens"]  # EOS ignored: exactly as asked
    assert all(t > 0 for t in result["ttfts"]) and all(t > 0 for t in result["tpots"])
    assert all(e >= t for e, t in zip(result["e2els"], result["ttfts"]))
    assert all(len(itls) >= 1 for itls in result["itls"])
    assert result["mean_server_prefill_ms"] > 0 and result["backend"] == "splitserve"


def test_status_reports_the_vocabulary_and_the_context(deployment):
    with Client(deployment.address) as client:
        status = client.status()
    assert (status.vocab_size, status.max_model_len) == (2048, 4096)  # the tiny preset


def test_open_loop_at_a_rate(deployment, tmp_path):
    path = tmp_path / "result.json"
    out = run_bench(
        "--addr",
        deployment.address,
        "--num-prompts",
        "12",
        "--dataset",
        "random",
        "--input-len",
        "32",
        "--output-len",
        "8",
        "--range-ratio",
        "0.5",
        "--request-rate",
        "20",
        "--seed",
        "3",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--save-result",
        str(path),
    )
    assert "============ Serving Benchmark Result ============" in out.stdout
    result = json.loads(path.read_text())
    assert [k for k in RESULT_KEYS if k not in result] == []
    assert result["client_machine"]["logical_cores"] >= 1 and "avx2" in result["client_machine"]["isa"]
    assert "Client machine:" in out.stdout
    assert_all_served(result, 12)
    assert len(set(result["output_lens"])) > 1 and min(result["output_lens"]) >= 4  # lengths in 8 * [0.5, 1.5]
    assert result["request_rate"] == 20 and result["max_concurrency"] is None
    assert result["request_goodput"] == pytest.approx(12 / result["duration"])  # generous SLOs: every request
    assert result["total_output_tokens"] == sum(result["output_lens"])


def test_where_the_time_went(deployment, tmp_path):
    """The router's and the workers' metrics read before and after the run: each worker's loop phases add up
    to its wall clock over the run, and the router relayed every token the clients received."""
    path = tmp_path / "result.json"
    out = run_bench(
        "--addr",
        deployment.address,
        "--num-prompts",
        "8",
        "--input-len",
        "32",
        "--output-len",
        "8",
        "--request-rate",
        "20",
        "--save-result",
        str(path),
    )
    result = json.loads(path.read_text())
    assert_all_served(result, 8)
    table = out.stdout.split("=== Where the time went ===", 1)[1].splitlines()
    assert table[1].split() == ["Worker", "loop", "(s,", "share)", "prefill-0", "decode-0"]
    assert [line.split(":")[0].strip() for line in table[3:11]] == [
        "run (model)",
        *("schedule", "apply", "stream", "commands", "lock_wait", "other", "idle"),
    ]
    assert "Relay cost per token (us):" in out.stdout and "no timeline" not in out.stderr
    timeline = result["timeline"]
    assert [w["worker_id"] for w in timeline["workers"]] == ["prefill-0", "decode-0"]
    for worker in timeline["workers"]:
        phases = worker["phases_s"]
        assert worker["wall_s"] >= result["duration"] * 0.9
        assert sum(phases.values()) == pytest.approx(worker["wall_s"], rel=0.05), worker
        assert worker["diff_s"] == pytest.approx(worker["sum_s"] - worker["wall_s"])
        assert phases["run"] > 0 and phases["idle"] > 0 and min(phases.values()) >= 0, worker
    router = timeline["router"]
    assert router["relayed_tokens"] == result["total_output_tokens"] == 64
    assert router["relay_s"] > 0 and router["relay_us_per_token"] == pytest.approx(router["relay_s"] / 64 * 1e6)


def test_closed_loop_never_exceeds_the_concurrency(deployment, tmp_path):
    path = tmp_path / "result.json"
    run_bench(
        "--addr",
        deployment.address,
        "--num-prompts",
        "12",
        "--input-len",
        "24",
        "--output-len",
        "6",
        "--max-concurrency",
        "4",
        "--save-result",
        str(path),
    )
    result = json.loads(path.read_text())
    assert_all_served(result, 12)
    assert result["max_concurrency"] == 4 and result["request_rate"] == "inf"
    # Everything was due at 0: a request's queue time is when it was sent; no more than 4 in flight at once.
    spans = [(q, q + e) for q, e in zip(result["client_queue_times"], result["e2els"])]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 4
    assert sorted(result["client_queue_times"])[4] > 0 and result["p99_client_queue_ms"] > 0


def test_mooncake_trace_replay_hits_the_prefix_cache(deployment, tmp_path):
    path = tmp_path / "result.json"
    run_bench(
        "--addr",
        deployment.address,
        "--dataset",
        "mooncake",
        "--dataset-path",
        str(SAMPLE_TRACE),
        "--num-prompts",
        "6",
        "--save-result",
        str(path),
    )
    result = json.loads(path.read_text())
    assert_all_served(result, 6)
    last_due_s = read_trace(SAMPLE_TRACE, 6)[-1]["timestamp"] / 1e3  # 0.781 s: sent then, so the run ends later
    assert result["request_rate"] == "trace" and result["duration"] >= last_due_s
    assert max(result["cached_lens"]) >= 512  # hash id 0 opens every prompt: the same first block


def test_sweep_over_two_rates(deployment, tmp_path):
    out = run_bench(
        "sweep",
        "--addr",
        deployment.address,
        "--rates",
        "10,40",
        "--num-prompts",
        "6",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--out-dir",
        str(tmp_path),
    )
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["slo_attainment"] for r in sweep["results"]] == [1.0, 1.0]
    assert sweep["goodput"]["status"] == "at_least" and sweep["goodput"]["rate"] == 40
    assert "goodput: >= 40 req/s" in out.stdout
    for name in ("ttft.png", "tpot.png", "attainment.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    rate_10 = json.loads((tmp_path / "rate_10.json").read_text())
    assert_all_served(rate_10, 6)
    assert rate_10["timeline"]["router"]["relayed_tokens"] == 24  # each rate's own run: 6 requests of 4 tokens
    assert out.stderr.count("=== Where the time went ===") == 2


def test_requests_past_their_deadline_are_counted_as_failed(deployment, tmp_path):
    path = tmp_path / "result.json"
    run_bench(
        "--addr",
        deployment.address,
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "64",
        "--save-result",
        str(path),
        timeout_s=0.002,
        returncode=1,
    )
    result = json.loads(path.read_text())
    assert result["completed"] == 0 and result["failures"] == {"DEADLINE_EXCEEDED": 4}
    assert all(e.startswith("DEADLINE_EXCEEDED") for e in result["errors"]) and result["output_lens"] == [0] * 4


def test_the_openai_backend_measures_as_the_grpc_one(deployment, tmp_path):
    """The same load over splitserve's OpenAI port: the same result keys, every token counted, sane times."""
    workload = ("--num-prompts", "6", "--input-len", "16", "--output-len", "6", "--max-concurrency", "3", "--seed", "5")
    run_bench("--addr", deployment.address, *workload, "--save-result", str(tmp_path / "grpc.json"))
    out = run_bench(
        "--backend",
        "openai",
        "--base-url",
        f"http://{deployment.openai_address}",
        "--vocab-size",
        "2048",
        *workload,
        "--save-result",
        str(tmp_path / "openai.json"),
    )
    grpc_result, result = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("grpc", "openai"))
    assert "============ Serving Benchmark Result ============" in out.stdout
    # No splitserve router to find the metrics through: a one-line note instead of the table.
    assert "no timeline of where the time went: --backend openai" in out.stderr
    assert "Where the time went" not in out.stdout and "timeline" in grpc_result
    assert sorted(result) == sorted(key for key in grpc_result if key != "timeline")
    assert result["backend"] == "openai" and result["model_id"] == grpc_result["model_id"] != ""
    assert result["failed"] == 0 and result["completed"] == 6 and result["total_output_tokens"] == 36
    assert result["input_lens"] == grpc_result["input_lens"]  # the same prompts
    assert result["output_lens"] == result["expected_output_lens"] == [6] * 6  # from the usage chunk
    assert all(0 < t <= e for t, e in zip(result["ttfts"], result["e2els"])) and all(t > 0 for t in result["tpots"])
    assert all(len(itls) >= 1 for itls in result["itls"]) and result["mean_itl_ms"] > 0
    assert result["mean_server_prefill_ms"] > 0  # splitserve's timing object, read from the finished choice
    assert result["max_concurrency"] == 3 and result["output_throughput"] > 0


def test_the_openai_backend_reads_where_the_time_went_from_timeline_addr(deployment, tmp_path):
    """Over splitserve's OpenAI port, with the router's gRPC address as --timeline-addr: the same table and key
    as over gRPC, the router's relay counted for every token the OpenAI clients received."""
    path = tmp_path / "openai.json"
    out = run_bench(
        "--backend",
        "openai",
        "--base-url",
        f"http://{deployment.openai_address}",
        "--timeline-addr",
        deployment.address,
        "--vocab-size",
        "2048",
        *("--num-prompts", "5", "--input-len", "16", "--output-len", "7", "--max-concurrency", "5"),
        "--save-result",
        str(path),
    )
    result = json.loads(path.read_text())
    assert result["backend"] == "openai" and result["failed"] == 0 and result["completed"] == 5
    assert "=== Where the time went ===" in out.stdout and "no timeline" not in out.stderr
    timeline = result["timeline"]
    assert [w["worker_id"] for w in timeline["workers"]] == ["prefill-0", "decode-0"]
    for worker in timeline["workers"]:
        assert sum(worker["phases_s"].values()) == pytest.approx(worker["wall_s"], rel=0.05), worker
    assert timeline["router"]["relayed_tokens"] == result["total_output_tokens"] == 35


def test_timeline_addr_is_for_the_openai_backend_only(deployment):
    out = run_bench("--addr", deployment.address, "--timeline-addr", deployment.address, returncode=2)
    assert "--timeline-addr: only with --backend openai" in out.stderr


def test_the_openai_backend_names_a_model_the_server_lacks(deployment):
    out = run_bench(
        "--backend",
        "openai",
        "--base-url",
        f"http://{deployment.openai_address}",
        "--model",
        "other",
        "--vocab-size",
        "2048",
        "--num-prompts",
        "1",
        returncode=1,
    )
    assert "not 'other' (--model)" in out.stderr
