"""A real evaluation client against the router: lm-eval-harness's ``local-completions`` model scores the
local multiple-choice task in tests/openai/lm_eval_task (echo + logprobs over each context and choice)
through the OpenAI API, offline (no hub, no network), and its log-likelihoods equal transformers' on the
same fp32 checkpoint, with the same tokens (lm-eval's own encoding of each context and choice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "splitserve_mc"
TOL = 1e-4


def run_lm_eval(served, model_dir: Path, out: Path) -> list[dict]:
    """lm-eval's command line, as a user runs it; returns the task's logged samples."""
    model_args = ",".join(
        [
            f"model={served.router.model_name}",
            f"base_url=http://{served.openai_address}/v1/completions",
            f"tokenizer={model_dir}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env = {**os.environ, **offline, "HF_DATASETS_CACHE": str(out / "datasets"), "HF_HOME": str(out / "hf")}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", "4"]
    command += ["--log_samples", "--output_path", str(out / "results")]
    done = subprocess.run(command, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"lm_eval failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    (samples,) = (out / "results").rglob(f"samples_{TASK}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


@torch.inference_mode()
def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    tokens = torch.tensor([context + continuation])
    rows = torch.log_softmax(hf(tokens).logits[0].float(), dim=-1)[len(context) - 1 : -1]
    target = torch.tensor(continuation)
    chosen = rows.gather(1, target[:, None])[:, 0]
    return float(chosen.sum()), bool((rows.argmax(dim=-1) == target).all())


def test_lm_eval_local_completions_scores_as_transformers(served, serving_model, tmp_path):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM

    samples = run_lm_eval(served, serving_model, tmp_path)
    docs = [json.loads(line) for line in (TASK_DIR / f"{TASK}.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs)
    # lm-eval's own encoding of (context, continuation), so both sides score the same tokens.
    encoder = LocalCompletionsAPI(
        model=served.router.model_name,
        base_url="http://unused",
        tokenizer=str(serving_model),
        tokenizer_backend="huggingface",
    )
    hf = AutoModelForCausalLM.from_pretrained(serving_model, dtype=torch.float32).eval()
    scored = 0
    for sample in samples:
        doc = sample["doc"]
        assert len(sample["arguments"]) == len(sample["resps"]) == len(doc["choices"])
        for (context, continuation), (response,) in zip(
            ((a["arg_0"], a["arg_1"]) for a in sample["arguments"].values())
            if isinstance(sample["arguments"], dict)
            else sample["arguments"],
            sample["resps"],
        ):
            context_ids, continuation_ids = encoder._encode_pair(context, continuation)
            want, want_greedy = hf_loglikelihood(hf, context_ids, continuation_ids)
            got, got_greedy = float(response[0]), response[1] in (True, "True")
            assert got == pytest.approx(want, abs=TOL * len(continuation_ids))
            assert got_greedy == want_greedy
            scored += 1
    assert scored == sum(len(d["choices"]) for d in docs)
