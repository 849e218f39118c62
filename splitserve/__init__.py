"""splitserve: disaggregated prefill/decode LLM serving on Ray, over gRPC.

Everything is imported from this one namespace. The parts keep folders of their own at the top of the
repository and are installed under it by setuptools' ``package-dir`` mapping (pyproject.toml):

    splitserve.engine          <- engine/
    splitserve.kv_transfer     <- kv_transfer/
    splitserve.worker_common   <- worker_common/
    splitserve.prefill_worker  <- prefill_worker/
    splitserve.decode_worker   <- decode_worker/
    splitserve.router          <- router/

An installed package (a wheel, or ``pip install -e .``) resolves these by itself. A source tree used
without installing (``PYTHONPATH=.``, as ``scripts/gpu_check.sh`` runs on a bare GPU machine) gets the
same mapping from the small finder below, which only acts when this file sits in a splitserve checkout.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

PARTS = ("engine", "kv_transfer", "worker_common", "prefill_worker", "decode_worker", "router")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Maps ``splitserve.<part>`` to ``<checkout>/<part>/`` and nothing else."""

    def __init__(self, root: Path) -> None:
        self.parts = {f"{__name__}.{part}": root / part for part in PARTS}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.parts.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _checkout_root() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or 'name = "splitserve"' not in pyproject.read_text(encoding="utf-8"):
        return None
    return root if all((root / part / "__init__.py").is_file() for part in PARTS) else None


_root = _checkout_root()
if _root is not None and not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
    # First, so a checkout used from its own folder maps to its own folders, not another editable install's.
    sys.meta_path.insert(0, _SourceTreeFinder(_root))
del _root
