"""engine/hardware.py: the machine description every benchmark prints and writes into its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.engine import hardware

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_isa_cap(monkeypatch):
    """These tests read the flags of the cpuinfo texts they pass; a cap in the environment (``make test-avx2``)
    would stand in for them. The tests of the cap set it themselves."""
    monkeypatch.delenv(hardware.ISA_OVERRIDE_ENV, raising=False)


# Two processors of an AVX-512 + BF16 machine (flags abridged), as the kernel prints them.
AVX512_CPUINFO = """\
processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD EPYC 9R45 64-Core Processor
flags		: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 vaes

processor	: 1
vendor_id	: AuthenticAMD
model name	: AMD EPYC 9R45 64-Core Processor
flags		: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 vaes
"""

AVX2_CPUINFO = """\
processor	: 0
model name	: AMD EPYC
flags		: fpu sse2 avx avx2 fma
"""

AMX_CPUINFO = """\
processor	: 0
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 avx_vnni
"""


def test_parse_avx512_bf16_machine():
    info = hardware.parse_cpuinfo(AVX512_CPUINFO)
    assert info["cpu_model"] == "AMD EPYC 9R45 64-Core Processor"
    assert info["processors"] == 2
    isa = info["isa"]
    assert isa["avx2"] and isa["avx512f"] and isa["avx512bw"] and isa["avx512_bf16"]
    assert not isa["amx_bf16"] and not isa["amx_tile"] and not isa["avx_ne_convert"]
    assert set(isa) == set(hardware.ISA_FLAGS)


def test_parse_avx2_only_machine():
    info = hardware.parse_cpuinfo(AVX2_CPUINFO)
    assert info["cpu_model"] == "AMD EPYC"
    assert info["processors"] == 1
    assert info["isa"]["avx2"]
    assert [name for name, on in info["isa"].items() if on] == ["avx2", "fma"]


def test_parse_amx_machine_and_flag_names_are_whole_words():
    isa = hardware.parse_cpuinfo(AMX_CPUINFO)["isa"]
    assert isa["amx_bf16"] and isa["amx_tile"] and isa["avx512_fp16"] and isa["avx_vnni"]
    # "avx512_vnni" must not be read out of "avx_vnni" (substring matching would).
    assert not isa["avx512_vnni"]


def test_parse_empty_or_unreadable_cpuinfo():
    info = hardware.parse_cpuinfo("")
    assert info["cpu_model"] is None and info["processors"] is None
    assert not any(info["isa"].values())


def test_describe_machine_is_json_and_names_versions():
    m = hardware.describe_machine(cpuinfo_text=AVX512_CPUINFO)
    assert json.loads(json.dumps(m)) == m
    assert m["cpu_model"] == "AMD EPYC 9R45 64-Core Processor"
    assert m["isa"]["avx512_bf16"] is True
    assert m["logical_cores"] == os.cpu_count()
    assert 1 <= m["usable_cores"] <= m["logical_cores"]
    import torch

    assert m["torch"] == torch.__version__
    assert m["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(m["onednn_bf16"], bool)


def test_header_names_every_field():
    m = hardware.describe_machine(cpuinfo_text=AVX512_CPUINFO)
    m["transformers"] = "5.24.0"
    text = hardware.header_lines(dtype="bfloat16", threads=2, device="cpu", machine=m)
    for needle in (
        "AMD EPYC 9R45 64-Core Processor",
        f"{m['logical_cores']} logical cores",
        f"({m['usable_cores']} usable)",
        "avx2 yes",
        "avx512f yes",
        "avx512bw yes",
        "avx512_bf16 yes",
        "amx_bf16 no",
        "avx_ne_convert no",
        f"torch {m['torch']}",
        f"cpu capability {m['torch_cpu_capability']}",
        "oneDNN bf16",
        "transformers 5.24.0",
        f"python {m['python']}",
        "device cpu",
        "dtype bfloat16",
        "threads 2",
    ):
        assert needle in text, (needle, text)


def test_header_says_no_for_missing_flags_and_libraries():
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AVX2_CPUINFO)
    m["transformers"] = None
    text = hardware.header_lines(dtype="float32", threads=1, machine=m)
    assert "avx2 yes" in text and "avx512f no" in text and "avx512_bf16 no" in text
    assert "transformers not installed" in text
    assert "cpu capability" not in text  # torch was not asked
    assert "dtype float32" in text and "threads 1" in text


def test_describe_without_torch_probe_does_not_import_torch():
    code = (
        "import sys, json; from engine import hardware; m = hardware.describe_machine(probe_torch=False); "
        "print(json.dumps({'torch_loaded': 'torch' in sys.modules, 'torch': m['torch'], "
        "'heavy': sorted(k for k in ('grpc', 'ray', 'router', 'splitserve') if k in sys.modules)}))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    reply = json.loads(out.stdout)
    assert reply["torch_loaded"] is False
    assert reply["heavy"] == []
    assert reply["torch"]  # read from the installed metadata


def test_cpu_summary_names_model_cores_and_isa():
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AVX512_CPUINFO)
    assert hardware.cpu_summary(m) == f"AMD EPYC 9R45 64-Core Processor, {m['usable_cores']} cores, AVX-512, BF16"
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AVX2_CPUINFO)
    assert hardware.cpu_summary(m).endswith("AVX2, no BF16")
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AMX_CPUINFO)
    assert hardware.cpu_summary(m).endswith("AVX-512, AMX")


def test_isa_override_replaces_the_flags_and_the_header_says_so(monkeypatch):
    """``SPLITSERVE_CPU_ISA`` stands for another CPU's flags: what the engine decides from them follows."""
    monkeypatch.delenv(hardware.ISA_OVERRIDE_ENV, raising=False)
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AMX_CPUINFO)
    assert m["isa_override"] is None and m["native_bf16"] is True
    monkeypatch.setenv(hardware.ISA_OVERRIDE_ENV, "avx2, FMA")
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AMX_CPUINFO)
    assert m["isa_override"] == "avx2, FMA" and m["native_bf16"] is False
    assert [name for name, on in m["isa"].items() if on] == ["avx2", "fma"]
    assert hardware.cpu_isa() == m["isa"]
    assert "flags from SPLITSERVE_CPU_ISA='avx2, FMA'" in hardware.header_lines(machine=m)
    monkeypatch.setenv(hardware.ISA_OVERRIDE_ENV, "avx2,avx9000")
    with pytest.raises(ValueError, match=r"SPLITSERVE_CPU_ISA: unknown ISA flags \['avx9000'\]"):
        hardware.cpu_isa()


def test_library_isa_caps_are_reported_and_named_in_the_header(monkeypatch):
    """ONEDNN_MAX_CPU_ISA and the like make this CPU compute as a lesser one: a figure says so."""
    for name in hardware.ISA_LIMIT_ENVS:
        monkeypatch.delenv(name, raising=False)
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AVX512_CPUINFO)
    assert m["isa_limits"] == {}
    assert "libraries capped" not in hardware.header_lines(machine=m)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    m = hardware.describe_machine(probe_torch=False, cpuinfo_text=AVX512_CPUINFO)
    assert m["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert json.loads(json.dumps(m))["isa_limits"] == m["isa_limits"]
    assert "(libraries capped: ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2)" in hardware.header_lines(machine=m)
    assert m["isa"]["avx512_bf16"], "the CPU's own flags stay as read"


def test_native_bf16_and_onednn_bf16_from_the_flags():
    avx2 = hardware.parse_cpuinfo(AVX2_CPUINFO)["isa"]
    avx512 = hardware.parse_cpuinfo(AVX512_CPUINFO)["isa"]
    amx = hardware.parse_cpuinfo(AMX_CPUINFO)["isa"]
    assert [hardware.native_bf16(i) for i in (avx2, avx512, amx)] == [False, True, True]
    assert [hardware.onednn_bf16_isa(i) for i in (avx2, avx512, amx)] == [False, True, True]
    assert hardware.onednn_bf16_isa(hardware.parse_isa_list("avx2,avx_ne_convert"))
    assert not hardware.native_bf16(hardware.parse_isa_list("avx2,avx_ne_convert"))


def test_as_avx2_caps_torch_and_onednn_and_the_header_names_it():
    """scripts/as_avx2.sh: torch's kernels run at AVX2, oneDNN refuses bf16 (as on an AVX2-only CPU), our own
    flags say AVX2 only, and the printed header names every cap."""
    code = (
        "import json, torch; from engine import hardware; m = hardware.describe_machine(); "
        "print(json.dumps({'cap': m['torch_cpu_capability'], 'onednn_bf16': m['onednn_bf16'], "
        "'native_bf16': m['native_bf16'], 'limits': m['isa_limits'], 'header': hardware.header_lines(machine=m)}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in hardware.ISA_LIMIT_ENVS + (hardware.ISA_OVERRIDE_ENV,)}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [str(ROOT / "scripts" / "as_avx2.sh"), sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    assert reply["cap"] == "AVX2"
    assert reply["onednn_bf16"] is False
    assert reply["native_bf16"] is False
    assert reply["limits"] == {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert "libraries capped: ONEDNN_MAX_CPU_ISA=AVX2" in reply["header"]
    assert "flags from SPLITSERVE_CPU_ISA='avx2,fma'" in reply["header"]
    bare = subprocess.run([str(ROOT / "scripts" / "as_avx2.sh")], capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2 and "usage" in bare.stderr
