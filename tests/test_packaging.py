"""What gets installed, and the import layers (docs/architecture.md).

Everything installs under the one name ``splitserve``: each part folder's packages are listed in
pyproject.toml (a new subpackage cannot be forgotten), the wheel holds nothing else at its top, an
installed copy imports as ``splitserve.<part>`` while ``import engine`` fails, and
scripts/check_layers.py both passes on this tree and fails on an upward import or a cycle.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
# What a copy of the checkout leaves out: history, environments, caches, and what builds write.
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", ".peer", "models", "results", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)


def package_folders() -> dict[str, Path]:
    """Every folder with an __init__.py under a mapped folder, by the package name it installs as."""
    found: dict[str, Path] = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in relative:
                found[".".join((name, *relative))] = init.parent
    return found


def test_every_package_folder_is_listed_in_pyproject_and_every_listed_one_exists():
    listed = set(SETUPTOOLS["packages"])
    found = package_folders()
    assert "splitserve.router.openai" in found and "splitserve.bench" in found
    assert sorted(set(found) - listed) == [], "folders with an __init__.py that pyproject.toml does not install"
    assert sorted(listed - set(found)) == [], "packages in pyproject.toml without a folder"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (the build writes build/ and egg-info next to the source)."""
    source = tmp_path_factory.mktemp("source") / "splitserve"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    (built,) = dist.glob("splitserve-*.whl")
    return built


def test_the_wheel_installs_nothing_outside_splitserve(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"splitserve"}, sorted(tops)
    for expected in (
        "splitserve/engine/core.py",
        "splitserve/router/openai/server.py",
        "splitserve/prefill_worker/__main__.py",
        "splitserve/colocated_worker/worker.py",
        "splitserve/worker_common/prefill_edge/service.py",
        "splitserve/kv_transfer/tp/handoff.py",
        "splitserve/bench/data/mooncake_sample.jsonl",
        # The C++ sources the engine compiles on first use (engine/native.py).
        "splitserve/engine/attention/cpu_paged_decode.cpp",
        "splitserve/engine/model/cpu_gemv.cpp",
        "splitserve/engine/cpu_block_cache.cpp",
    ):
        assert expected in names
    # Benchmarks and harnesses stay in the checkout (docs/architecture.md).
    assert "splitserve/kv_transfer/bench.py" not in names and "splitserve/drill.py" not in names


def test_an_installed_copy_imports_as_splitserve_only(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    code = (
        "import importlib, importlib.util, sys\n"
        "for name in ('splitserve.router.server', 'splitserve.engine.core', 'splitserve.kv_transfer.sender',\n"
        "             'splitserve.worker_common.base', 'splitserve.prefill_worker.worker',\n"
        "             'splitserve.decode_worker.worker', 'splitserve.colocated_worker.worker',\n"
        "             'splitserve.deploy.roles'):\n"
        "    module = importlib.import_module(name)\n"
        "    assert module.__file__.startswith(sys.argv[1]), (name, module.__file__)\n"
        "for generic in ('engine', 'router', 'kv_transfer', 'worker_common', 'prefill_worker', 'decode_worker',\n"
        "                'colocated_worker'):\n"
        "    assert importlib.util.find_spec(generic) is None, generic\n"
        "print('imported')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(site)], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr
    # Each worker's entry point is installed and passes its own class (worker_common imports neither).
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.decode_worker", "--help"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--max-inflight" in done.stdout, done.stderr


def test_docs_show_the_contracts_as_pyproject_has_them():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    contracts = text[text.index("[tool.importlinter]\n") : text.index("[tool.pytest.ini_options]")].strip()
    assert contracts in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def run_check_layers(pyproject: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_layers.py"), "--pyproject", str(pyproject)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layer_contracts_hold_on_this_tree():
    done = run_check_layers(ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"Contracts: \d+ kept, 0 broken\.", done.stdout) and "No import cycle" in done.stdout
    assert "No two-way tie between the launcher's packages." in done.stdout


def test_check_layers_fails_on_an_upward_import_and_on_a_lazy_cycle(tmp_path):
    tree = tmp_path / "checkout"
    shutil.copytree(ROOT, tree, ignore=NOT_COPIED)
    # The engine reaching up into the router: the layers contract breaks.
    (tree / "engine" / "upward.py").write_text("from splitserve.router import server\n")
    # Two modules of one layer importing each other inside functions only: allowed by the layers, a cycle.
    (tree / "splitserve" / "common" / "ping.py").write_text("def f():\n    from splitserve.common import pong\n")
    (tree / "splitserve" / "common" / "pong.py").write_text("def f():\n    from splitserve.common import ping\n")
    done = run_check_layers(tree / "pyproject.toml")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "splitserve.engine.upward -> splitserve.router.server" in done.stdout
    assert "splitserve.common.ping -> splitserve.common.pong (line 2)" in done.stdout
    assert "splitserve.common.pong -> splitserve.common.ping (line 2)" in done.stdout


def test_check_layers_fails_on_a_two_way_tie_between_launcher_packages(tmp_path):
    tree = tmp_path / "checkout"
    shutil.copytree(ROOT, tree, ignore=NOT_COPIED)
    # planning imports deploy; a deploy module reaching back into planning, inside a function, ties them.
    (tree / "splitserve" / "deploy" / "back.py").write_text("def f():\n    from splitserve.planning import plan\n")
    done = run_check_layers(tree / "pyproject.toml")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Two-way tie in the launcher: splitserve.deploy and splitserve.planning import each other" in done.stdout


def test_splitserve_and_the_router_never_import_vllm():
    """vllm (the optional engine backend) is imported only by a worker that runs it."""
    code = (
        "import sys, splitserve, splitserve.cli, splitserve.router.server, splitserve.router.openai.server, "
        "splitserve.deploy.deployment, splitserve.worker_common.base, splitserve.colocated_worker.worker; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
