"""What machine a figure was measured on: CPU model and ISA flags, cores, library versions.

Every benchmark prints ``header_lines(...)`` first and puts ``describe_machine(...)`` in the JSON it
writes, because the same machine kind comes with different processors: one day AVX-512 with BF16
(oneDNN runs bf16 natively), the next AVX2 only (bf16 is emulated and the prepacked path refuses it).
A figure without the machine beside it cannot be compared with anything.

``$SPLITSERVE_CPU_ISA`` (a comma-separated list of ``ISA_FLAGS`` names, e.g. ``avx2,fma``) replaces the
flags read from /proc/cpuinfo, so that a machine with native bf16 can take the engine's decisions of one
without it (tests, and measuring those decisions): ``describe_machine`` reports the flags it used and
``isa_override`` (the variable's value, or None), and the header says so. It changes what the engine
decides from the flags (``native_bf16``, ``onednn_bf16_isa``), not what the CPU or torch's own
dispatch does.

To measure as on a CPU with fewer ISA extensions, the libraries' own caps do change what runs:
``ONEDNN_MAX_CPU_ISA`` (oneDNN's kernels, and torch's "oneDNN bf16" answer that follows from them),
``ATEN_CPU_CAPABILITY`` (torch's vectorized kernels) and ``MKL_ENABLE_INSTRUCTIONS`` (MKL's).
``describe_machine`` reports those that are set (``isa_limits``) and the header names them, so a figure
measured under them never passes for one of the CPU itself (docs/performance.md, "An AVX2-only CPU,
emulated").

Torch-light on purpose: nothing here imports gRPC, Ray, the router or ``splitserve``, transformers'
version is read from its installed metadata (never imported), and torch is only asked about when the
caller says so (``probe_torch``), so torch-free tools can describe the machine too.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

# The ISA flags that decide which kernels torch and oneDNN can use for our dtypes, as /proc/cpuinfo
# spells them. avx512_bf16 or amx_bf16 give native bf16 dot products; oneDNN's bf16 path also runs
# on avx512bw+vl+dq or avx_ne_convert, and refuses plain AVX2.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
    "avx_ne_convert",
)

CPUINFO = Path("/proc/cpuinfo")
ISA_OVERRIDE_ENV = "SPLITSERVE_CPU_ISA"
# The libraries' own ISA caps, read when they start: set, they make this CPU compute as a lesser one would.
ISA_LIMIT_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def isa_limits() -> dict[str, str]:
    """The ``ISA_LIMIT_ENVS`` that are set in this process's environment, with their values."""
    return {name: os.environ[name] for name in ISA_LIMIT_ENVS if os.environ.get(name)}


def isa_override() -> str | None:
    """``$SPLITSERVE_CPU_ISA`` when set (an empty value means "no flags at all"), else None."""
    return os.environ.get(ISA_OVERRIDE_ENV)


def parse_isa_list(text: str) -> dict[str, bool]:
    """``"avx2, fma"`` -> ``ISA_FLAGS`` -> bool; a name outside ``ISA_FLAGS`` is a ValueError naming it."""
    names = {name.strip().lower() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(ISA_FLAGS))
    if unknown:
        raise ValueError(f"{ISA_OVERRIDE_ENV}: unknown ISA flags {unknown} (known: {', '.join(ISA_FLAGS)})")
    return {name: name in names for name in ISA_FLAGS}


def native_bf16(isa: dict[str, bool]) -> bool:
    """Whether the CPU computes bf16 dot products natively (AVX512_BF16 or AMX-BF16). Without them, as on
    an AVX2-only EPYC, every bf16 product is emulated through float32 conversions."""
    return bool(isa.get("avx512_bf16") or isa.get("amx_bf16"))


def onednn_bf16_isa(isa: dict[str, bool]) -> bool:
    """Whether these flags meet oneDNN's bf16 requirement ("avx_ne_convert, or avx512bw, avx512vl and
    avx512dq"): its prepacked bf16 path runs (natively or emulated) only then."""
    return bool(isa.get("avx_ne_convert") or (isa.get("avx512bw") and isa.get("avx512vl") and isa.get("avx512dq")))


def cpu_isa() -> dict[str, bool]:
    """This machine's ISA flags, or ``$SPLITSERVE_CPU_ISA``'s when it is set."""
    override = isa_override()
    return parse_cpuinfo(_read_cpuinfo())["isa"] if override is None else parse_isa_list(override)


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The model name, processor count and ISA flags (``ISA_FLAGS`` -> bool) from /proc/cpuinfo text.

    Only the first processor's block is read for the name and flags (every core of a VM reports the
    same); ``processors`` counts the ``processor`` lines. Missing fields come back as None / False.
    """
    model, flags, processors = None, None, 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            processors += 1
        elif key == "model name" and model is None:
            model = value
        elif key in ("flags", "Features") and flags is None:  # "Features" on arm64
            flags = set(value.split())
    flags = flags or set()
    return {
        "cpu_model": model,
        "processors": processors or None,
        "isa": {name: name in flags for name in ISA_FLAGS},
    }


def _read_cpuinfo() -> str:
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_facts(device: str | None) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
    }
    if device is not None and device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        facts["gpu"] = torch.cuda.get_device_name(index)
    return facts


def describe_machine(
    device: str | None = None, probe_torch: bool = True, cpuinfo_text: str | None = None
) -> dict[str, Any]:
    """A JSON-ready description of this machine and the library versions a figure depends on.

    ``probe_torch=False`` reports torch's installed version without importing it (no capability,
    oneDNN or GPU fields then). ``cpuinfo_text`` replaces /proc/cpuinfo (tests); ``$SPLITSERVE_CPU_ISA``
    replaces its flags (``isa_override``).
    """
    info = parse_cpuinfo(_read_cpuinfo() if cpuinfo_text is None else cpuinfo_text)
    override = isa_override()
    info["isa_override"] = override
    if override is not None:
        info["isa"] = parse_isa_list(override)
    info["native_bf16"] = native_bf16(info["isa"])
    info["isa_limits"] = isa_limits()
    info["cpu_model"] = info["cpu_model"] or platform.processor() or platform.machine() or None
    info["logical_cores"] = os.cpu_count()
    info["usable_cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info["python"] = platform.python_version()
    info["transformers"] = _package_version("transformers")
    if probe_torch:
        info.update(_torch_facts(device))
    else:
        info["torch"] = _package_version("torch")
    return info


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def cpu_summary(machine: dict[str, Any]) -> str:
    """One short line for a table row: model, usable cores and the widest vector ISA with bf16."""
    isa = machine["isa"]
    widest = "AVX-512" if isa["avx512f"] else "AVX2" if isa["avx2"] else "no AVX2"
    bf16 = "AMX" if isa["amx_bf16"] else "BF16" if isa["avx512_bf16"] or isa["avx_ne_convert"] else "no BF16"
    return f"{machine['cpu_model'] or 'unknown'}, {machine['usable_cores']} cores, {widest}, {bf16}"


def header_lines(
    dtype: str | None = None,
    threads: int | str | None = None,
    device: str | None = None,
    machine: dict[str, Any] | None = None,
) -> str:
    """The header every benchmark prints first: machine, ISA flags, cores, versions, dtype, threads.

    ``threads`` is a count or a phrase ("1 per worker"). ``machine`` is a ``describe_machine()`` result
    (computed here when omitted), so the printed header and the JSON a benchmark writes describe the
    same thing.
    """
    m = describe_machine(device) if machine is None else machine
    isa = m["isa"]
    amx = isa["amx_tile"] and isa["amx_bf16"]
    cpu = (
        f"cpu: {m['cpu_model'] or 'unknown'}, {m['logical_cores']} logical cores "
        f"({m['usable_cores']} usable); avx2 {_yes_no(isa['avx2'])}, avx512f {_yes_no(isa['avx512f'])}, "
        f"avx512bw {_yes_no(isa['avx512bw'])}, avx512_bf16 {_yes_no(isa['avx512_bf16'])}, "
        f"amx_bf16 {_yes_no(amx)}, avx_ne_convert {_yes_no(isa['avx_ne_convert'])}"
    )
    if m.get("isa_override") is not None:
        cpu += f" (flags from {ISA_OVERRIDE_ENV}={m['isa_override']!r}, not the CPU's)"
    torch_part = f"torch {m.get('torch') or 'not installed'}"
    if "torch_cpu_capability" in m:
        torch_part += (
            f" (cpu capability {m['torch_cpu_capability']}, oneDNN bf16 {_yes_no(m['onednn_bf16'])}"
            f"{', cuda ' + m['cuda'] if m.get('cuda') else ''})"
        )
    if m.get("isa_limits"):
        limits = ", ".join(f"{k}={v}" for k, v in m["isa_limits"].items())
        torch_part += f" (libraries capped: {limits})"
    versions = f"{torch_part}, transformers {m.get('transformers') or 'not installed'}, python {m['python']}"
    run = [f"device {device or 'cpu'}"]
    if m.get("gpu"):
        run.append(f"gpu {m['gpu']}")
    run.append(f"dtype {dtype or '-'}")
    run.append(f"threads {threads if threads is not None else '-'}")
    return "\n".join([cpu, versions, "run: " + ", ".join(run)])


def print_header(
    dtype: str | None = None,
    threads: int | str | None = None,
    device: str | None = None,
    machine: dict[str, Any] | None = None,
    to_stderr: bool = False,
) -> dict[str, Any]:
    """Print the header (to stderr when stdout carries JSON) and return the machine dict for the JSON."""
    m = describe_machine(device) if machine is None else machine
    print(header_lines(dtype, threads, device, m), file=sys.stderr if to_stderr else sys.stdout, flush=True)
    return m
