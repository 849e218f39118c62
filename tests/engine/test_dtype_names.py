"""--dtype takes vLLM's names everywhere; the canonical name is what configs, status and logs keep."""

from __future__ import annotations

import argparse

import pytest
import torch

from splitserve.cli import build_parser
from splitserve.engine.model.loader import DTYPE_NAMES, canonical_dtype, parse_dtype

ALIASES = [
    (("bfloat16", "bf16", "BF16"), torch.bfloat16),
    (("float16", "half", "fp16"), torch.float16),
    (("float32", "float", "fp32"), torch.float32),
]


@pytest.mark.parametrize("names, dtype", ALIASES)
def test_every_alias_parses_to_one_dtype(names: tuple[str, ...], dtype: torch.dtype):
    assert {parse_dtype(n) for n in names} == {dtype}
    assert {canonical_dtype(n) for n in names} == {str(dtype).removeprefix("torch.")}


def test_auto_takes_the_checkpoints_dtype():
    assert parse_dtype("auto", "bfloat16") is torch.bfloat16
    assert parse_dtype("auto", "float16") is torch.float16
    assert parse_dtype("auto", None) is torch.float32
    assert canonical_dtype("auto") == "auto" and set(DTYPE_NAMES.values()) == {"auto", "bfloat16", "float16", "float32"}


@pytest.mark.parametrize("bad", ["int8", "fp8", "", "bfloat"])
def test_unknown_names_are_refused_naming_the_field(bad: str):
    with pytest.raises(ValueError, match=r"dtype: .* is not supported"):
        parse_dtype(bad)


def test_the_cli_canonicalizes_and_refuses():
    parser = build_parser()
    assert parser.parse_args(["serve", "--dtype", "half"]).dtype == "float16"
    assert parser.parse_args(["generate", "--model", "m", "--dtype", "fp32"]).dtype == "float32"
    assert parser.parse_args(["make-model", "--preset", "tiny", "--out", "x", "--dtype", "bf16"]).dtype == "bfloat16"
    for argv in (["serve", "--dtype", "int4"], ["make-model", "--preset", "tiny", "--out", "x", "--dtype", "auto"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    with pytest.raises(argparse.ArgumentTypeError, match="auto"):
        from splitserve.cli import checkpoint_dtype_arg

        checkpoint_dtype_arg("auto")
