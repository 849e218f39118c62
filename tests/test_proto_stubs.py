"""The generated stubs under splitserve/ must be exactly what proto/ generates (run `make proto`)."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_match_the_proto_files(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT,
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    stale = [
        str(p) for p in generated if not (ROOT / p).is_file() or not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)
    ]
    assert not stale, f"stubs out of date with proto/: {stale}; run `make proto`"
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "splitserve").rglob("*_pb2*.py*"))
    assert committed == generated, "splitserve/ holds stubs that no .proto generates"
