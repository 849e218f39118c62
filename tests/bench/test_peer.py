"""The peer's plumbing (splitserve.bench.peer) without vLLM: core lists, the --peer choice, failures reported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from splitserve.bench import peer


def test_cpu_lists_are_written_as_vllm_reads_them():
    assert peer.cpu_list([0, 1]) == "0-1"
    assert peer.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert peer.cpu_list([3]) == "3"
    env = peer.peer_env([0, 1], kv_cache_gib=1.0)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"], env["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == (
        "0-1",
        "2",
        "0",
    )
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "PYTHONPATH" not in env


def test_pinned_cpus_are_usable_ones():
    cpus = peer.pinned_cpus(1)
    assert len(cpus) == 1 and cpus[0] in os.sched_getaffinity(0)


def test_a_missing_peer_is_not_measured_and_says_so(tmp_path: Path, capsys):
    assert peer.peer_python(str(tmp_path / "bin" / "python"), no_peer=False) is None
    assert "vLLM: not measured (run make peer)" in capsys.readouterr().err
    assert peer.peer_python(sys.executable, no_peer=True) is None
    assert peer.peer_python(sys.executable, no_peer=False) == Path(sys.executable)


def test_a_failing_peer_is_reported_with_what_it_printed(tmp_path: Path):
    # The project's own python has no vllm: the peer script fails at its import, and the error says so.
    result = peer.run_offline(
        Path(sys.executable), tmp_path, "float32", [0], timeout_s=60, log_path=tmp_path / "peer.log"
    )
    assert "error" in result and "vllm" in result["error"]
    assert "vllm" in (tmp_path / "peer.log").read_text()


FAKE_CLIENT = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
assert args[:4] == ["-m", "vllm.entrypoints.cli.main", "bench", "serve"], args
opt = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
print("fake client", opt["--base-url"], opt["--max-concurrency"], opt["--random-input-len"])
if opt["--base-url"].endswith(":1"):
    sys.exit(3)
result = {k: 1.0 for k in ("duration", "total_output_tokens", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                           "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms")}
result["completed"] = int(opt["--num-prompts"]) - 1
if "--percentile-metrics" in opt and "e2el" in opt["--percentile-metrics"]:
    result["mean_e2el_ms"] = 2.0
Path(opt["--result-dir"], opt["--result-filename"]).write_text(json.dumps(result))
"""


def test_vllm_bench_serve_is_run_with_the_workload_and_its_result_read(tmp_path: Path):
    """A stand-in for the peer's python (it checks the command line and writes the result file as `vllm bench
    serve` does): the workload's options reach it, its saved result comes back under CLIENT_KEYS with the
    failed requests counted, and a client that fails is reported with what it printed."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_CLIENT}")
    fake.chmod(0o755)
    args = dict(served_name="m", tokenizer=tmp_path, prompt_len=512, new_tokens=128, num_prompts=32)
    log_path = tmp_path / "client.log"
    got = peer.vllm_bench_serve(fake, "http://127.0.0.1:8", max_concurrency=16, timeout_s=60, log_path=log_path, **args)
    assert set(peer.CLIENT_KEYS) <= got.keys() and got["completed"] == 31 and got["failed"] == 1
    assert got["mean_e2el_ms"] == 2.0
    assert "fake client http://127.0.0.1:8 16 512" in log_path.read_text()
    failed = peer.vllm_bench_serve(fake, "http://127.0.0.1:1", max_concurrency=16, timeout_s=60, **args)
    assert "exit code 3" in failed["error"] and "fake client" in failed["error"]
