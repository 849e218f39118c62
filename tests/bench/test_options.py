"""``splitserve bench`` refuses bad options by name, before it loads anything, and says when the
server cannot be reached."""

from __future__ import annotations

import pytest

from splitserve.bench import DATASETS
from splitserve.bench.datasets import PRESETS
from splitserve.cli import build_parser, main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rates", "1,2"], "--rates: only with `splitserve bench sweep`"),
        (["sweep", "--rates", "1"], "--rates, --out-dir: both required"),
        (["sweep", "--rates", "1", "--out-dir", "x", "--save-result", "r.json"], "--save-result"),
        (["sweep", "--rates", "1", "--out-dir", "x", "--dataset", "mooncake"], "--dataset mooncake"),
        (["--goodput", "ttft"], "--goodput"),
        (["--percentiles", "90,x"], "--percentiles"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--request-timeout", "0"], "--request-timeout"),
    ],
)
def test_bad_options_are_refused_by_name(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_server_fails_at_once(capsys):
    assert main(["bench", "--addr", "127.0.0.1:1", "--num-prompts", "1", "--no-progress"]) == 1
    assert "cannot read the server's status at 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err


def test_defaults_follow_vllm():
    args = build_parser().parse_args(["bench"])
    assert (args.action, args.addr, args.num_prompts, args.dataset) == (None, "127.0.0.1:50051", 1000, "random")
    assert args.request_rate == float("inf") and args.burstiness == 1.0 and args.max_concurrency is None
    assert args.temperature == 0.0 and args.ignore_eos and args.request_timeout == 600.0
    assert build_parser().parse_args(["bench", "--no-ignore-eos"]).ignore_eos is False
    sweep = build_parser().parse_args(["bench", "sweep", "--goodput", "ttft:1", "tpot:2", "--rates", "1,2"])
    assert sweep.action == "sweep" and sweep.goodput == ["ttft:1", "tpot:2"]
    assert set(PRESETS) < set(DATASETS)
