#!/usr/bin/env bash
# Run a command as on an AVX2-only CPU (no AVX-512, no native bf16), on a CPU that has more.
#
#   scripts/as_avx2.sh .venv/bin/python scripts/bench_serve.py --serve-dtype auto ...
#
# Caps every library that picks kernels by ISA, before it starts (children and Ray workers inherit them):
#   ONEDNN_MAX_CPU_ISA=AVX2       oneDNN's kernels; torch then answers "oneDNN bf16: no", as on such a CPU
#   ATEN_CPU_CAPABILITY=avx2      torch's vectorized kernels (bf16 converted through float32)
#   MKL_ENABLE_INSTRUCTIONS=AVX2  MKL's
#   SPLITSERVE_CPU_ISA=avx2,fma   the flags splitserve's own decisions read (engine/hardware.py)
# splitserve's own kernels are built without what the cap takes away (-mno-avx512f, under a build key of their
# own: engine/native.py). What it cannot change: the memory system, clocks and caches are this machine's. The
# benchmark header names the caps ("libraries capped: ..."), so such a figure never passes for one of the CPU
# itself.
set -euo pipefail
if [ "$#" -eq 0 ]; then
    echo "usage: scripts/as_avx2.sh COMMAND [ARGS...]" >&2
    exit 2
fi
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 SPLITSERVE_CPU_ISA=avx2,fma
exec "$@"
