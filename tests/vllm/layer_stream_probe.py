"""A vLLM prefill worker's engine (``VllmEngine``, role prefill) stepping one prompt in a process of its own
(vllm changes torch's thread settings process-wide): prints, as JSON, each ``on_layer_done`` call of the step
with the layers the KV connector had reported saved at that moment, and the model's layer count.

    python -m tests.vllm.layer_stream_probe MODEL_DIR
"""

from __future__ import annotations

import json
import sys
import threading


def main() -> None:
    from splitserve.engine.core import EngineConfig
    from splitserve.engine.sampling.params import SamplingParams
    from splitserve.engine.scheduler.request import Request
    from splitserve.worker_common.vllm_engine import VllmEngine

    config = EngineConfig(model_dir=sys.argv[1], dtype="float32", backend="vllm", kv_cache_bytes=64 << 20)
    engine = VllmEngine(config, threading.RLock(), role="prefill")
    request = Request("probe", list(range(1, 200)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add(request)
    calls: list[tuple[int, int]] = []
    step = engine.schedule()
    engine.run(step, "prefill", on_layer_done=lambda n: calls.append((n, engine._link.layers_saved)))
    print(json.dumps({"calls": calls, "layers": engine.model.num_layers, "tokens": request.num_output_tokens}))
    engine.close()


if __name__ == "__main__":
    main()
