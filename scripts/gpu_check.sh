#!/usr/bin/env bash
# The GPU checks, as one prepared script: the engine's parity tests against transformers, the engine
# benchmark, the tensor-parallel engine on every visible GPU (scripts/gpu_tp_check.py), and where a GPU's
# time goes (scripts/gpu_bench.py: decode and prefill against the device's measured bounds and
# transformers, for the qwen2.5-0.5b and llama3.1-8b presets; under 8 minutes).
#
#   scripts/gpu_check.sh                 # on a GPU machine: --device cuda
#   scripts/gpu_check.sh --device cpu    # the rehearsal on the CPU, whole (make gpu-check)
#   scripts/gpu_check.sh --bench-only    # only scripts/gpu_bench.py
#   scripts/gpu_check.sh --keep-going    # run every section even after one fails (a first run on a new machine)
#   scripts/gpu_check.sh --device cpu --quick-tests
#                                        # make test's rehearsal: the tests section runs a few files (the suite
#                                        # has just run them all), every other section as it is
#
# Each section runs under its own deadline (the TIMEOUT_* variables below, overridable from the environment; the
# defaults sum to under 8 minutes on a GPU) and the script ends with one summary table: section, result, seconds.
# It exits non-zero when any section failed or ran out of time.
#
# It uses whatever `python3` the machine has (override with PYTHON=...), with the tree on PYTHONPATH and
# nothing installed: it needs torch, transformers, safetensors, tokenizers, msgpack, hypothesis and pytest,
# and imports only engine/, kv_transfer/ (not its gRPC service), the checkpoint writer (splitserve/tools/make_model.py)
# and the profile's measurement (splitserve/planning/) from the tree. No Ray, no network. Results go to $OUT when set (the device tool collects that folder), else to a temp folder.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
BENCH_ONLY=0
KEEP_GOING=0
QUICK_TESTS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    --bench-only) BENCH_ONLY=1; shift ;;
    --keep-going) KEEP_GOING=1; shift ;;
    --quick-tests) QUICK_TESTS=1; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--bench-only] [--keep-going] [--quick-tests]" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
RESULTS=${OUT:-$(mktemp -d)}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false

# Each section's deadline, in seconds. On a GPU they sum to 7 minutes and 50 seconds; the CPU rehearsal runs
# smaller sizes on 2 cores and gets more.
if [[ "$DEVICE" == cuda* ]]; then d=(150 70 60 50 140); else d=(360 240 240 240 240); fi
T_TESTS=${TIMEOUT_TESTS:-${d[0]}}
T_BENCH=${TIMEOUT_BENCH:-${d[1]}}
T_PROFILE=${TIMEOUT_PROFILE:-${d[2]}}
T_TP=${TIMEOUT_TP:-${d[3]}}
T_GPU_BENCH=${TIMEOUT_GPU_BENCH:-${d[4]}}

SUMMARY=()
FAILED=0
section() {  # section NAME FUNCTION: runs it in a subshell under set -e, records the result, stops on failure
  local name=$1 fn=$2 t0 rc result
  echo "== $name"
  t0=$(date +%s)
  set +e
  ( set -euo pipefail; "$fn" )
  rc=$?
  set -e
  case $rc in
    0) result=ok ;;
    124|137) result="timed out" ;;
    *) result="failed (exit $rc)" ;;
  esac
  SUMMARY+=("$(printf '| %-34s | %-16s | %7s |' "$name" "$result" "$(( $(date +%s) - t0 ))")")
  if [ $rc -ne 0 ]; then
    FAILED=1
    if [ "$KEEP_GOING" = 0 ]; then summary; exit "$rc"; fi
  fi
}
summary() {
  echo "== summary: scripts/gpu_check.sh --device $DEVICE"
  printf '| %-34s | %-16s | %7s |\n' section result seconds
  printf '| %-34s | %-16s | %7s |\n' "$(printf -- '-%.0s' {1..34})" "$(printf -- '-%.0s' {1..16})" "-------"
  printf '%s\n' "${SUMMARY[@]}" | tee "$RESULTS/gpu_check_summary.md"
  for f in bench_engine.txt profile.txt gpu_tp_check.txt gpu_bench_table.txt; do
    [ -s "$RESULTS/$f" ] && { echo "-- $f"; cat "$RESULTS/$f"; }
  done
  return 0
}

environment() {
  "$PY" - "$DEVICE" <<'PYEOF'
import sys, torch
from splitserve.engine.hardware import print_header
device = sys.argv[1]
if device.startswith("cuda"):
    assert torch.cuda.is_available(), "--device cuda but torch sees no GPU"
print_header(dtype="float32, bfloat16", threads=torch.get_num_threads(), device=device)
PYEOF
}

tests() {
  # tests/kv_transfer/test_units.py runs real gloo pairs with the KV cache on $DEVICE: on CUDA that is the
  # path that stages payloads through pinned host memory (NCCL needs two GPUs; its pair logic is covered
  # there by a fake NCCL-like group).
  # tests/engine/test_parity_paths.py is the parity on the linear-layer paths we ship (hidden-512 models):
  # all of it on CUDA (fp32 and bf16 through cuBLAS); the CPU rehearsal keeps only its bf16 tests (about
  # 25 s), since `make test` has just run the fp32 ones on the CPU paths.
  # --quick-tests (make test, which has just run the whole suite on the CPU): the transfer tests, the greedy
  # parity against transformers and the two decode paths' tests, enough to show the section works here.
  local select=() files=(tests/engine tests/kv_transfer/test_units.py)
  if [ "$QUICK_TESTS" = 1 ]; then
    files=(tests/kv_transfer/test_units.py tests/engine/test_parity.py tests/engine/test_paged_decode.py
      tests/engine/test_static_decode.py)
  elif [[ "$DEVICE" != cuda* ]]; then
    select=(-k "not test_fp32_greedy_on_every_linear_path")
  fi
  SPLITSERVE_REPORT_FAILURES_AT_ONCE=1 timeout "$T_TESTS" "$PY" -m pytest "${files[@]}" -q -p no:cacheprovider \
    --device "$DEVICE" "${select[@]}" -rfExX --durations=10 2>&1 | tee "$RESULTS/gpu_check_tests.log"
}

bench() {
  if [[ "$DEVICE" == cuda* ]]; then
    timeout "$T_BENCH" "$PY" scripts/bench_engine.py --device "$DEVICE" --model "$WORK/qwen2.5-0.5b" --json --no-peer \
      --repeats 2 > "$RESULTS/bench_engine.json"
  else
    # The rehearsal: the same script end to end, on the tiny preset and small sizes.
    timeout "$T_BENCH" "$PY" scripts/bench_engine.py --device cpu --preset tiny --dtype float32 --model "$WORK/tiny" \
      --prompt-len 16 --new-tokens 8 --decode-batches 1,4 --hf-batches 1,4 --repeats 1 --json --no-peer \
      > "$RESULTS/bench_engine.json"
  fi
  "$PY" - "$RESULTS/bench_engine.json" <<'PYEOF' | tee "$RESULTS/bench_engine.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({k: r[k] for k in ("device", "dtype", "ratios", "targets") if k in r}, indent=1))
for b, d in r["splitserve"]["decode"].items():
    print(f"splitserve decode batch {b}: {d['tok_s']:.1f} tok/s, {d['ms_per_step']:.2f} ms/step, "
          f"{d['fraction_of_linear_bound']:.2f} of the F.linear bound")
PYEOF
}

profile() {
  # The engine's steps on the model the engine benchmark wrote, fitted; and the real KV transfer (sender,
  # receiver, gloo payload) with both ends in this process and the control stream in memory, since the
  # gRPC service is not importable here. A transfer fit the samples do not determine is left out of the
  # profile and printed as such ("not measured: ..."): never a stand-in figure.
  local profiled pdtype
  if [[ "$DEVICE" == cuda* ]]; then profiled="$WORK/qwen2.5-0.5b" pdtype=bfloat16; else profiled="$WORK/tiny" pdtype=float32; fi
  timeout "$T_PROFILE" "$PY" - "$profiled" "$pdtype" "$DEVICE" "$RESULTS/profile.json" <<'PYEOF' | tee "$RESULTS/profile.txt"
import sys
from splitserve.planning.measure import Grid, measure_profile
from splitserve.deploy.profile import Profile, relative_errors
model, dtype, device, out = sys.argv[1:5]
grid = Grid() if device.startswith("cuda") else Grid().scaled(0.3)
profile = measure_profile(model, dtype, device, grid=grid, transfer_in_process=True)
profile.save(out)
assert Profile.load(out) == profile, "the profile reads back as written"
errors = sorted(relative_errors(profile))
c = profile.step_coefficients
print(f"profile of {profile.model.name} on {profile.device_name} ({dtype}): step = {c['const'] * 1e3:.3f} ms + "
      f"{c['prefill_tokens'] * 1e6:.3f} us/prompt token + {c['decodes'] * 1e6:.3f} us/decode + "
      f"{c['decode_context'] * 1e6:.3f} us/1k context; fit median error {errors[len(errors) // 2]:.1%}; {out}")
for t in profile.transfers:
    print(f"KV transfer of {t.bytes} B: {t.seconds * 1e3:.3f} ms (median of {grid.repeats})")
if profile.transfer is not None:
    print(f"KV transfer = {profile.transfer.latency_s * 1e3:.3f} ms + bytes / "
          f"{profile.transfer.bytes_per_s / 1e9:.2f} GB/s ({profile.notes['transfer_path']})")
else:
    print(f"KV transfer: {profile.parts['transfer']}")
print(f"parts: {profile.parts}")
PYEOF
}

tensor_parallel() {
  # One rank per visible GPU over NCCL; on a one-GPU machine two ranks share it over gloo (the table says
  # which): the sharded loader, rank 0's step plans and the all-reduce on the device, greedy output = TP 1.
  timeout "$T_TP" "$PY" scripts/gpu_tp_check.py --device "${DEVICE%%:*}" --json-out "$RESULTS/gpu_tp_check.json" \
    2>&1 | grep -v "linear_tuner" | tee "$RESULTS/gpu_tp_check.txt"
}

gpu_bench() {
  # Its --budget is the section's deadline less a margin: a slow step costs its row, not the table.
  timeout "$T_GPU_BENCH" "$PY" scripts/gpu_bench.py --device "$DEVICE" --budget $(( T_GPU_BENCH - 15 )) \
    --json-out "$RESULTS/gpu_bench.json" | tee "$RESULTS/gpu_bench.txt"
  grep '^|' "$RESULTS/gpu_bench.txt" > "$RESULTS/gpu_bench_table.txt" || true
}

section "environment" environment
if [ "$BENCH_ONLY" = 0 ]; then
  section "parity, engine, KV-transfer tests" tests
  section "engine benchmark" bench
  section "device profile (docs/planning.md)" profile
  section "tensor parallelism" tensor_parallel
fi
section "where the time goes (gpu_bench)" gpu_bench
summary
if [ "$FAILED" = 1 ]; then echo "== gpu_check FAILED ($DEVICE); results in $RESULTS"; exit 1; fi
echo "== gpu_check passed ($DEVICE); results in $RESULTS"
