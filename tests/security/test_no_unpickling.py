"""Nothing in our code unpickles or evaluates data: no pickle, cloudpickle, marshal or dill, no
``torch.load`` without ``weights_only=True``, no ``eval``/``exec``, no unsafe YAML loader. (Ray pickles
actor arguments between our own processes on its own channels; see docs/security.md.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "router",
    "prefill_worker",
    "decode_worker",
    "kv_transfer",
    "worker_common",
    "engine",
    "splitserve",
    "scripts",
)
FORBIDDEN = {
    "a pickle-family module": re.compile(
        r"^\s*(import|from)\s+(c?pickle|_pickle|cloudpickle|dill|marshal|shelve|joblib)\b"
        r"|\b(c?pickle|cloudpickle|dill|marshal)\.\w+|\bUnpickler\b",
        re.M,
    ),
    "torch.load without weights_only=True": re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"),
    "eval or exec": re.compile(r"(?<![\w.])(eval|exec)\s*\("),
    "an unsafe YAML loader": re.compile(
        r"\byaml\.(load|load_all|unsafe_load|full_load)\s*\(|yaml\.(Unsafe|Full)?Loader\b"
    ),
    "numpy.load with allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
}


def sources() -> list[Path]:
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    return [p for p in files if not re.search(r"_pb2(_grpc)?\.pyi?$", p.name)]


def code_only(text: str) -> str:
    """Source without its prose: docstrings emptied, comments dropped."""
    text = re.sub(r'"""[\s\S]*?"""', '""""""', text)
    return "\n".join(line.split("  # ", 1)[0] for line in text.splitlines() if not line.lstrip().startswith("#"))


def test_the_scan_sees_our_code():
    names = {p.relative_to(ROOT).as_posix() for p in sources()}
    assert {
        "kv_transfer/descriptor.py",
        "router/server.py",
        "engine/model/loader.py",
        "splitserve/deploy/deployment.py",
    } <= names
    assert not any(n.endswith("_pb2.py") for n in names)


@pytest.mark.parametrize(
    "bad",
    [
        "import pickle",
        "from cloudpickle import loads",
        "x = marshal.loads(b)",
        "torch.load(path)",
        "torch.load(f, map_location='cpu')",
        "eval(text)",
        "yaml.load(stream)",
        "np.load(f, allow_pickle=True)",
    ],
)
def test_the_patterns_catch_what_they_name(bad):
    assert any(p.search(bad) for p in FORBIDDEN.values())


@pytest.mark.parametrize(
    "fine",
    [
        "model.eval()",
        "yaml.safe_load(text)",
        "torch.load(f, weights_only=True)",
        "msgpack.unpackb(data, raw=False)",
        "# never pickle on the wire",
    ],
)
def test_the_patterns_leave_safe_code_alone(fine):
    assert not any(p.search(code_only(fine)) for p in FORBIDDEN.values())


def test_nothing_unpickles_or_evaluates():
    found = [
        f"{path.relative_to(ROOT)}: {what}: {match.group(0).strip()!r}"
        for path in sources()
        for what, pattern in FORBIDDEN.items()
        for match in pattern.finditer(code_only(path.read_text()))
    ]
    assert not found, "\n".join(found)
