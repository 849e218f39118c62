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
    # Written as it runs (a first start compiles for minutes: the log shows how far it is), read back at the end.
    with tempfile.TemporaryFile("w+") if log_path is None else _open_log(log_path) as log:
        proc = subprocess.Popen(
            cmd,
            env=peer_env(cpus, kv_cache_gib),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout_s)
            killed = ""
        except subprocess.TimeoutExpired:
            killed = f"\n(killed after the {timeout_s:.0f} s deadline)"
        finally:
            _kill_group(proc)  # on a timeout, and vLLM's engine-core children, should any outlive their parent
        log.seek(0)
        out = log.read() + killed
    for line in reversed(out.splitlines()):
        if line.startswith("{") and '"engine": "vllm"' in line:
            return json.loads(line) | {"wall_s": time.perf_counter() - start}
    tail = "\n".join(out.splitlines()[-25:])
    return {"error": f"exit code {proc.returncode}; last lines:\n{tail}"}


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
