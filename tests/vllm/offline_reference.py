"""vLLM's own offline ``LLM`` on a checkpoint, in a process of its own (vllm changes torch's thread settings
process-wide, so it never runs in the test process): prints the greedy token ids of each prompt as JSON.

    python -m tests.vllm.offline_reference MODEL_DIR MAX_TOKENS PROMPTS_JSON
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        enforce_eager=True,
        compilation_config={"mode": 0},
        kv_cache_memory_bytes=64 << 20,
        max_model_len=1024,
        disable_log_stats=True,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))


if __name__ == "__main__":
    main()
