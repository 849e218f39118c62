"""scripts/check_test_asserts.py: a test without an assert, ``pytest.raises`` or an asserting helper
is flagged with its file and line; tests that assert directly or through helpers pass."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_test_asserts.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_test_asserts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def test_a_test_without_an_assert_is_flagged_by_file_and_line(tmp_path):
    write(
        tmp_path,
        "helpers.py",
        """
        def verify_things(x):
            assert x

        def indirect(x):
            verify_things(x)

        def quiet(x):
            return x
    """,
    )
    write(
        tmp_path,
        "test_sample.py",
        """
        import pytest

        def test_direct():
            assert 1 + 1 == 2

        def test_raises():
            with pytest.raises(ValueError):
                int("x")

        def test_named_helper():
            assert_all_good()

        def test_through_helpers():
            indirect(3)

        def test_cannot_fail():
            quiet(1)

        class TestGroup:
            def test_method_without_assert(self):
                print("hi")

        @pytest.fixture
        def test_like_fixture():
            return 1
    """,
    )
    checker = load_checker()
    offenders = checker.find_offenders(checker.test_files([tmp_path]))
    assert len(offenders) == 2, offenders
    assert offenders[0].startswith(f"{tmp_path / 'test_sample.py'}:17: test_cannot_fail")
    assert offenders[1].startswith(f"{tmp_path / 'test_sample.py'}:21: test_method_without_assert")


def test_the_script_exits_1_on_an_offender_and_0_on_the_repository(tmp_path):
    write(tmp_path, "test_weak.py", "def test_weak():\n    x = 1\n")
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "test_weak.py:1: test_weak" in bad.stdout
    good = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stdout
