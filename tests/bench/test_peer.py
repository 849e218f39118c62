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
