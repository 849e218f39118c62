"""``splitserve.engine.model.cpu_norm``: the bf16 RMSNorm in one call equals transformers' chain bit for bit.

Against ``cpu_norm.reference`` (``weight * F.rms_norm(x.float()).to(bf16)``, transformers' order of operations)
at widths below, at and past torch's vector widths and their multiples (every branch of the sum's order: whole
vectors or not, fewer than one step of 4 vectors, cascades of one and several levels), at 1 to 40 rows
(threads split them), at scales from tiny to large, with zeros, a strided x, and special values; under torch's
AVX-512 kernels (16 lanes, where the CPU has them) and its AVX2 ones (8, in a process whose torch is capped by
``ATEN_CPU_CAPABILITY``). A sum in plain order, or a fused multiply-add in the squares, differs on these rows:
``test_a_plain_order_sum_would_differ`` holds the reference able to tell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from splitserve.engine.model import cpu_norm
from splitserve.engine.model.transformer import RMSNorm

pytestmark = pytest.mark.skipif(
    cpu_norm.EXTENSION.load() is None or cpu_norm.torch_width() is None,
    reason=f"the CPU norm kernel is unavailable here: {cpu_norm.EXTENSION.failure()}",
)

WIDTHS = [1, 7, 8, 15, 16, 17, 64, 100, 127, 128, 129, 511, 512, 896, 1000, 1536, 2048, 3584, 4096, 8192, 16384]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, but for NaNs' payloads: NaN where the reference has NaN (torch's vector and scalar conversions
    to bf16 give NaNs different bits themselves)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(bits(got)[~nan], bits(want)[~nan])


def case(n: int, rows: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * scale).to(torch.bfloat16)
    weight = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, weight


@pytest.mark.parametrize("n", WIDTHS)
def test_equals_the_reference_bit_for_bit(n):
    for rows, scale in ((1, 1.0), (3, 0.003), (16, 4.0), (40, 250.0)):
        x, weight = case(n, rows, scale, seed=n + rows)
        got = cpu_norm.rms_norm(x, weight, 1e-6)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        assert torch.equal(bits(got), bits(cpu_norm.reference(x, weight, 1e-6))), f"n={n} rows={rows}"


def test_zeros_strides_eps_and_special_values():
    x, weight = case(896, 6, 1.0, seed=3)
    x[1] = 0  # a zero row: rsqrt(eps)
    x[2, 5] = float("inf")
    x[3, 7] = float("nan")
    x[4, :] = 1e30  # squares past float32's range: inf
    for eps in (1e-6, 1e-5, 0.1):
        got, want = cpu_norm.rms_norm(x, weight, eps), cpu_norm.reference(x, weight, eps)
        assert want[2].isnan().any() and want[3].isnan().all() and want[1].eq(0).all()  # the cases bite
        assert same(got, want), f"eps={eps}"
    wide = torch.randn(5, 2000).to(torch.bfloat16)
    strided = wide[:, 100:996]  # rows 2000 apart, each contiguous
    assert strided.stride() == (2000, 1)
    assert torch.equal(bits(cpu_norm.rms_norm(strided, weight, 1e-6)), bits(cpu_norm.reference(strided, weight, 1e-6)))


def test_a_plain_order_sum_would_differ():
    """The reference tells the orders apart: a norm whose mean is summed in plain order differs on these rows."""
    x, weight = case(896, 40, 30.0, seed=11)
    x32 = x.float()
    sums = torch.tensor([sum(float(v) for v in row) for row in (x32 * x32)], dtype=torch.float64)
    plain = torch.zeros(40)
    for r in range(40):  # float32 running sum, in index order
        acc = torch.zeros((), dtype=torch.float32)
        for v in (x32[r] * x32[r]).tolist():
            acc = acc + torch.tensor(v, dtype=torch.float32)
        plain[r] = acc
    rstd = torch.rsqrt(plain / 896 + 1e-6)
    naive = weight * (x32 * rstd[:, None]).to(torch.bfloat16)
    assert not torch.equal(bits(naive), bits(cpu_norm.reference(x, weight, 1e-6)))
    assert torch.isfinite(sums).all()


def test_rejects_what_it_does_not_run():
    x, weight = case(64, 2, 1.0, seed=5)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_norm.rms_norm(x.float(), weight, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_norm.rms_norm(x, weight[:32], 1e-6)
    assert not cpu_norm.usable(weight.float(), 1e-6)
    assert not cpu_norm.usable(weight.half(), 1e-6)


def test_the_model_norm_uses_it_and_equals_transformers_chain():
    norm = RMSNorm(896, 1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x, _ = case(896, 3, 2.0, seed=9)
    with torch.inference_mode():
        got = norm(x)
    assert norm.fused is True
    want = norm.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(bits(got), bits(want))
    fp16 = RMSNorm(64, 1e-6).half()
    fp16(torch.randn(2, 64).half())
    assert fp16.fused is False


def test_a_failed_check_keeps_torch_operators(monkeypatch):
    monkeypatch.setattr(cpu_norm, "_checked", {})
    monkeypatch.setattr(cpu_norm, "rms_norm", lambda x, weight, eps: cpu_norm.reference(x, weight, eps) * 2)
    assert not cpu_norm.usable(torch.randn(96).to(torch.bfloat16), 1e-6)


CHILD = """
import json, torch
from splitserve.engine.model import cpu_norm
bad = []
for n in (7, 8, 9, 64, 100, 896, 1000, 2048, 4096, 8192):
    for rows, scale in ((1, 1.0), (9, 40.0)):
        gen = torch.Generator().manual_seed(n)
        x = (torch.randn(rows, n, generator=gen) * scale).to(torch.bfloat16)
        w = torch.randn(n, generator=gen).to(torch.bfloat16)
        got, want = cpu_norm.rms_norm(x, w, 1e-6), cpu_norm.reference(x, w, 1e-6)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            bad.append([n, rows])
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "width": cpu_norm.torch_width(), "bad": bad}))
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_equals_the_reference_under_other_torch_kernels(capability):
    """torch's AVX2 and default kernels sum in 8-lane vectors: the kernel follows them (same build, width 8)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["capability"] == capability.upper() and result["width"] == 8
    assert result["bad"] == []
