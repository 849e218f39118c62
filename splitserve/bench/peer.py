"""The peer in our benchmarks: vLLM's CPU build, in its own venv (``make peer`` builds ``.peer``), run as
a child process on the same checkpoint, dtype and cores as splitserve.

- ``run_offline``: scripts/peer_vllm.py (vLLM's offline ``LLM``) inside the peer's python, one JSON line back;
- ``VLLMServer``: ``vllm serve`` on a free loopback port, waited for on /health, stopped by its process
  group (which it leads: ``start_new_session``), always, with a deadline.

vLLM CPU takes its cores from the environment (docs/performance.md, "The peer"): the OpenMP threads
are bound to exactly the cores splitserve runs on, none reserved for its front end, and its KV cache
is sized to match ours. The first start compiles the model for minutes; later ones read ~/.cache/vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER_SCRIPT = ROOT / "scripts" / "peer_vllm.py"
NOT_MEASURED = "vLLM: not measured (run make peer)"


def default_peer_python(root: Path = ROOT) -> Path | None:
    """``.peer/bin/python`` of this checkout when `make peer` has built it, else None."""
    python = root / ".peer" / "bin" / "python"
    return python if python.is_file() else None


def peer_python(peer: str | None, no_peer: bool) -> Path | None:
    """The --peer / --no-peer choice: None means "not measured" (and says why on stderr)."""
    if no_peer:
        return None
    python = Path(peer) if peer else default_peer_python()
    if python is None or not python.is_file():
        print(NOT_MEASURED + (f": {python} is missing" if python else ""), file=sys.stderr, flush=True)
        return None
    return python


def pinned_cpus(threads: int) -> list[int]:
    """The first ``threads`` cores this process may run on: splitserve and the peer both get these."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads > len(allowed):
        raise ValueError(f"--threads: {threads} threads but only {len(allowed)} cores are usable ({allowed})")
    return allowed[:threads]


def cpu_list(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    parts, run = [], [cpus[0]]
    for c in cpus[1:]:
        if c == run[-1] + 1:
            run.append(c)
        else:
            parts.append(run)
            run = [c]
    parts.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in parts)


def peer_env(cpus: Sequence[int], kv_cache_gib: float) -> dict[str, str]:
    """vLLM CPU on exactly ``cpus`` (one OpenMP thread each, none reserved), a KV cache of kv_cache_gib."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": str(len(cpus)),
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM then SIGKILL to the process group the child leads; waits for it, bounded."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_offline(
    python: Path,
    model: Path,
    dtype: str,
    cpus: Sequence[int],
    timeout_s: float,
    extra: Sequence[str] = (),
    kv_cache_gib: float = 1.0,
    log_path: Path | None = None,
) -> dict:
    """scripts/peer_vllm.py in the peer's python; its JSON result, or {"error": what it printed last}."""
    cmd = [str(python), str(PEER_SCRIPT), "--model", str(model), "--dtype", dtype, *extra]
    start = time.perf_counter()
    returncode, out = _run_logged(cmd, peer_env(cpus, kv_cache_gib), timeout_s, log_path)
    for line in reversed(out.splitlines()):
        if line.startswith("{") and '"engine": "vllm"' in line:
            return json.loads(line) | {"wall_s": time.perf_counter() - start}
    return {"error": f"exit code {returncode}; last lines:\n{_last_lines(out)}"}


def _run_logged(cmd: list[str], env: dict[str, str], timeout_s: float, log_path: Path | None) -> tuple[int, str]:
    """Runs ``cmd`` as the leader of its own process group, its output written as it runs (a first vLLM start
    compiles for minutes: the log shows how far it is) to ``log_path`` (or a temporary file); waits at most
    ``timeout_s``, then ends the whole group (on a timeout, and any of vLLM's children that outlive their
    parent). Returns the exit code and the output, with a line saying so when the deadline killed it."""
    with tempfile.TemporaryFile("w+") if log_path is None else _open_log(log_path) as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            killed = ""
        except subprocess.TimeoutExpired:
            killed = f"\n(killed after the {timeout_s:.0f} s deadline)"
        finally:
            _kill_group(proc)
        log.seek(0)
        return proc.returncode, log.read() + killed


def _last_lines(out: str, n: int = 25) -> str:
    return "\n".join(out.splitlines()[-n:])


# The keys of `vllm bench serve`'s saved result that bench_serve reports (the same names as splitserve bench's).
CLIENT_KEYS = (
    "completed",
    "duration",
    "total_output_tokens",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_itl_ms",
    "mean_e2el_ms",
)


def vllm_bench_serve(
    python: Path,
    base_url: str,
    served_name: str,
    tokenizer: Path,
    prompt_len: int,
    new_tokens: int,
    num_prompts: int,
    max_concurrency: int,
    timeout_s: float,
    log_path: Path | None = None,
) -> dict:
    """vLLM's own client (`vllm bench serve` in the peer's python, a process of its own) against an OpenAI
    server: its random dataset (seed 0, prompts of exactly ``prompt_len`` tokens of ``tokenizer``, sent as text),
    ``new_tokens`` greedy tokens each with EOS ignored, at most ``max_concurrency`` in flight, every request
    sent at once. Returns its saved result under CLIENT_KEYS plus ``failed``, or {"error": ...}. Bounded by
    ``timeout_s`` (the process group is killed past it)."""
    with tempfile.TemporaryDirectory(prefix="splitserve-vbs-") as out_dir:
        cmd = [
            str(python),
            "-m",
            "vllm.entrypoints.cli.main",
            "bench",
            "serve",
            "--backend",
            "openai",
            "--endpoint",
            "/v1/completions",
            "--base-url",
            base_url,
            "--model",
            served_name,
            "--tokenizer",
            str(tokenizer),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(prompt_len),
            "--random-output-len",
            str(new_tokens),
            "--random-range-ratio",
            "0",
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(max_concurrency),
            "--request-rate",
            "inf",
            "--ignore-eos",
            "--temperature",
            "0",
            "--seed",
            "0",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--disable-tqdm",
            "--ready-check-timeout-sec",
            "60",
            "--save-result",
            "--result-dir",
            out_dir,
            "--result-filename",
            "result.json",
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env |= {"VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"}
        returncode, out = _run_logged(cmd, env, timeout_s, log_path)
        saved = Path(out_dir) / "result.json"
        if returncode != 0 or not saved.is_file():
            return {"error": f"vllm bench serve: exit code {returncode}; last lines:\n{_last_lines(out)}"}
        result = json.loads(saved.read_text())
    missing = [k for k in CLIENT_KEYS if k not in result]
    if missing:
        return {"error": f"vllm bench serve's result has no {missing}"}
    return {k: result[k] for k in CLIENT_KEYS} | {"failed": num_prompts - result["completed"], "failures": {}}


def _open_log(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w+")  # noqa: SIM115  (a context manager at the caller)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm serve`` of the peer's venv on 127.0.0.1, as a context manager that always stops it."""

    def __init__(
        self,
        python: Path,
        model: Path,
        dtype: str,
        cpus: Sequence[int],
        served_name: str,
        max_model_len: int = 2048,
        kv_cache_gib: float = 1.0,
        max_num_seqs: int = 32,
        log_path: Path | None = None,
    ) -> None:
        self.python, self.model, self.dtype, self.cpus = python, model, dtype, list(cpus)
        self.served_name, self.max_model_len, self.kv_cache_gib = served_name, max_model_len, kv_cache_gib
        self.max_num_seqs, self.log_path = max_num_seqs, log_path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.ready_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> str:
        """Starts it and waits for /health (the first start compiles for minutes); returns the base URL."""
        # The module entry point (the `vllm` script looks its version up under the dist name "vllm").
        cmd = [
            str(self.python),
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--served-model-name",
            self.served_name,
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--no-enable-prefix-caching",
            "--seed",
            "0",
        ]
        log = _open_log(self.log_path) if self.log_path else subprocess.DEVNULL  # closed in stop
        self._log = log
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            env=peer_env(self.cpus, self.kv_cache_gib),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = start + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with code {self.proc.returncode} before it was ready{self._tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2.0) as r:
                    if r.status == 200:
                        self.ready_s = time.perf_counter() - start
                        return self.base_url
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve was not healthy within {timeout_s:.0f} s{self._tail()}")

    def _tail(self, n: int = 25) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        self._log.flush()
        return "; last lines:\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc, grace_s=20.0)
            self.proc = None
        if self.log_path and getattr(self, "_log", None) is not None:
            self._log.close()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser, timeout_s: float, timeout_help: str) -> None:
    """The peer's flags, the same in every benchmark: ``--peer PYTHON``, ``--no-peer``, ``--peer-timeout``."""
    parser.add_argument(
        "--peer",
        default=None,
        metavar="PYTHON",
        help="the peer venv's python (default: .peer/bin/python when `make peer` has built it)",
    )
    parser.add_argument("--no-peer", action="store_true", help="do not measure vLLM")
    parser.add_argument("--peer-timeout", type=float, default=timeout_s, help=timeout_help)
