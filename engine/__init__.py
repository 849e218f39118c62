"""The model engine shared by every worker: model, paged KV cache, block manager, sampler, offline LLM.

One subpackage per subsystem (docs/engine.md, "Layout"): model/, attention/, kv_cache/, scheduler/,
sampling/, runner/, tp/, text/; core.py and llm.py put them together, wire.py converts at the edge.

Exports are loaded lazily so that torch-free modules (block hashing, block manager, sampling
parameters, tokenizer, detokenizer, stop strings) can be imported by the router without torch. For the
same reason every subpackage's ``__init__`` imports nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "splitserve.engine.llm",
    "EngineConfig": "splitserve.engine.core",
    "EngineCore": "splitserve.engine.core",
    "RequestOutput": "splitserve.engine.llm",
    "SamplingParams": "splitserve.engine.sampling.params",
    "SamplingParamsError": "splitserve.engine.sampling.params",
    "ModelConfig": "splitserve.engine.model.config",
    "BlockManager": "splitserve.engine.kv_cache.block_manager",
    "Tokenizer": "splitserve.engine.text.tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
