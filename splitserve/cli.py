"""The ``splitserve`` command line: a thin shell over the packages, no serving logic here."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "Disaggregated serving splits prefill and decode because",
    "def fibonacci(n):",
)


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint of a preset")
    p.add_argument("--preset", required=True, choices=["tiny", "small", "qwen2.5-0.5b"])
    p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", type=int, default=None, metavar="BYTES", help="shard the safetensors")
    p.add_argument("--config-format", default="legacy", choices=["legacy", "current"],
                   help="legacy: rope_theta/rope_scaling; current: rope_parameters")  # fmt: skip
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_make_model)


def _make_model(args: argparse.Namespace) -> int:
    from splitserve.make_model import make_model

    start = time.perf_counter()
    out = make_model(
        args.preset, args.out, dtype=args.dtype, seed=args.seed, max_shard_bytes=args.max_shard_size,
        config_format=args.config_format, overwrite=args.overwrite,
    )  # fmt: skip
    print(f"wrote {args.preset} ({args.dtype}) to {out} in {time.perf_counter() - start:.1f}s")
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run prompts through the offline engine (continuous batching)")
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: a few demo prompts")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
    )  # fmt: skip
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))  # fmt: skip
        else:
            print(f"--- {prompt!r}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} prompts, {total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s); "
          f"kv blocks {llm.kv_status()}", file=sys.stderr)  # fmt: skip
    llm.check_integrity()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_model(sub)
    _add_generate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"splitserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
