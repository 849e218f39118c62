"""The KV layout fingerprint of one rank of a worker (``splitserve.kv_transfer.descriptor``)."""

from __future__ import annotations

from pathlib import Path

from splitserve.engine.tp.layout import kv_head_range
from splitserve.kv_transfer.descriptor import LayoutFingerprint
from splitserve.worker_common.config import WorkerConfig
from splitserve.worker_common.engine_api import ModelFacts


def layout_fingerprint(config: WorkerConfig, model: ModelFacts) -> LayoutFingerprint:
    """What a KV transfer's two ends compare: the model, dtype and cache layout, the weights' checksum
    (the same at every TP size), and this rank's place in its worker (TP size, rank, KV heads held)."""
    tp, rank = config.engine.tensor_parallel_size, config.engine.tensor_parallel_rank
    heads = kv_head_range(model.num_kv_heads, tp, rank)
    return LayoutFingerprint(
        config.model_name or Path(config.engine.model_dir).name,
        model.dtype,
        model.block_size,
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
        model.weights_checksum,
        tp_size=tp,
        tp_rank=rank,
        heads_start=heads.start,
        heads_stop=heads.stop,
    )
