#!/usr/bin/env bash
# On the lent GPU machine, from the repo root, with .gpu-kit carried (make gpu-kit here first):
#
#   bash tools/gpu_kit/run.sh
#
# A lent GPU machine is there for about 15 minutes in all, its start-up included: the whole run
# is budgeted at 300 s (give the device call timeout_s=360), so a second, corrected run still fits
# on the same warm machine. The bench is small by default (0.25 GB, 2 reps); pytest gets what the
# steps before it left, less what the bench needs, and prints its slowest tests for the next plan.
# pytest runs the list in tools/gpu_kit/tests.txt (docs/gpus.md's one-GPU list), with
# TORCH_NCCL_NONBLOCKING_TIMEOUT=20 exported: a communicator that never forms lingers 20 s, not
# torch's 30 min, in the tests' processes.
#
# Steps, each recorded in $OUT/summary.txt (which starts with the GPU, driver, torch, CUDA and NCCL
# versions every figure of the run comes from); a step that fails or runs out of time does not stop
# the next one:
#   info      nvidia-smi, the interpreter, torch/grpcio/protobuf/numpy/numba versions, /dev/shm
#   stale     is the kit's weightsync wheel built from this tree? if not, rebuild it here
#   install   the kit's wheels the machine lacks (tools/gpu_kit/kit.py plan), pip --no-index
#             --no-deps into the machine's python; torch, grpcio and protobuf are never replaced
#             (a fallback grpcio/protobuf goes on PYTHONPATH for this run only if the machine's is
#             too old)
#   check     torch's version and CUDA unchanged, weightsync and the companions import, pip check
#   pytest    python3 -m pytest -q -rs -p no:cacheprovider --durations=15 <tools/gpu_kit/tests.txt>
#             (junit: $OUT/junit-gpu.xml; the tests' measurements: $OUT/measures.jsonl)
#   bench     python3 -m bench.gpu --out $OUT --gb 0.25 --reps 2  (gpu_bench.json, gpu_bench.md)
# Files in $OUT: run.log (everything), summary.txt, versions.txt, junit-gpu.xml, measures.jsonl,
# gpu_bench.json, gpu_bench.md.
#
# Environment: OUT (default /tmp/gpu-kit-out), GPU_PY (python3), GPU_KIT (.gpu-kit),
# GPU_KIT_TOTAL_S (300: the whole run, every step's limit included), GPU_KIT_INFO_S (the versions
# line and the info step, each at most this: 30; both wait for an import of torch), GPU_KIT_PYTEST_S
# (at most this for pytest: 225), GPU_KIT_BENCH_S (kept for the bench: 40), GPU_KIT_BENCH_ARGS (bench.gpu's
# arguments: "--gb 0.25 --reps 2"), GPU_KIT_TESTS (what pytest runs: tools/gpu_kit/tests.txt's list,
# or tests/gpu, or a rerun's test ids, space-separated), GPU_KIT_PYTEST_ARGS (more pytest arguments,
# e.g. --timeout 60), TORCH_NCCL_NONBLOCKING_TIMEOUT (20 unless set), GPU_KIT_DRY_RUN=1 (info and the
# install plan only: installs nothing, runs nothing).
# Exit status: 0 when every step passed, 1 otherwise.

# shellcheck disable=SC2317  # the step functions run through `bash -c NAME` (export -f)
set -u
cd "$(dirname "$0")/../.." || exit 2

OUT=${OUT:-/tmp/gpu-kit-out}
PY=${GPU_PY:-python3}
KIT=${GPU_KIT:-.gpu-kit}
TOTAL=${GPU_KIT_TOTAL_S:-300}
INFO_S=${GPU_KIT_INFO_S:-30}
PYTEST_S=${GPU_KIT_PYTEST_S:-225}
BENCH_S=${GPU_KIT_BENCH_S:-40}
BENCH_ARGS=${GPU_KIT_BENCH_ARGS:---gb 0.25 --reps 2}
TESTS=${GPU_KIT_TESTS:-$(grep -v '^#' tools/gpu_kit/tests.txt | tr '\n' ' ')}
DRY_RUN=${GPU_KIT_DRY_RUN:-0}
STATE=$(mktemp -d /tmp/gpu-kit-state.XXXXXX)
SUMMARY=$OUT/summary.txt
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
export OUT PY KIT STATE BENCH_ARGS TESTS

failures=0

# step NAME SECONDS FUNCTION: run FUNCTION (exported) under a time limit, record how it went.
step() {
  local name=$1 budget=$2 fn=$3 started=$SECONDS rc status
  if [ "$budget" -lt 5 ]; then
    printf '%-8s %-34s %5ss\n' "$name" "SKIPPED (no time left)" 0 >>"$SUMMARY"
    failures=$((failures + 1))
    return
  fi
  echo
  echo "=== $name (at most ${budget}s) ==="
  # SIGINT first: pytest then still writes its junit file and fixtures stop their servers.
  timeout -s INT -k 20 "$budget" bash -c "$fn"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMED OUT after ${budget}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || failures=$((failures + 1))
  printf '%-8s %-34s %5ss\n' "$name" "$status" "$((SECONDS - started))" >>"$SUMMARY"
  echo "=== $name: $status ==="
}

left() { echo $((TOTAL - SECONDS)); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

torch_state() {
  "$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available(), torch.version.cuda)'
}

# One line: what every figure of this run comes from (GPU, driver, torch, CUDA, NCCL).
gpu_versions() {
  local driver
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  "$PY" - "${driver:--}" <<'EOF'
import sys
import torch
try:
    nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
except (AttributeError, RuntimeError):
    nccl = "-"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"{gpu}, driver {sys.argv[1]}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")
EOF
}

versions() {
  "$PY" - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "grpcio", "protobuf", "numpy", "numba", "llvmlite", "pytest", "pytest-timeout",
             "safetensors", "structlog", "grpcio-health-checking", "grpcio-reflection",
             "grpcio-status", "googleapis-common-protos", "prometheus-client", "tqdm", "weightsync"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} -")
EOF
}

info() {
  date -u
  uname -r
  nvidia-smi || echo "nvidia-smi failed"
  nproc
  free -g | head -2
  df -h /dev/shm /tmp 2>&1
  ldd --version 2>&1 | head -1
  "$PY" -m pip --version
  versions
  torch_state | tee "$STATE/torch.before"
}

stale() {
  if "$PY" tools/gpu_kit/kit.py stale "$KIT"; then
    return 0
  fi
  if ! "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' 2>/dev/null; then
    echo "cannot rebuild it here (no setuptools>=68): installing the kit's wheel, built from other sources"
    return 1
  fi
  echo "rebuilding the weightsync wheel from this tree"
  rm -rf "$STATE/wheel"
  if "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$STATE/wheel" . >"$STATE/wheel.log" 2>&1; then
    rm -f "$KIT"/weightsync-*.whl
    cp "$STATE"/wheel/weightsync-*.whl "$KIT"/
    echo "rebuilt: $(ls "$STATE"/wheel)"
    return 0
  fi
  tail -20 "$STATE/wheel.log"
  echo "could not rebuild: installing the kit's weightsync wheel, built from other sources"
  return 1
}

install_kit() {
  "$PY" tools/gpu_kit/kit.py plan "$KIT" | tee "$STATE/plan.txt" || return 1
  local wheels overlay
  mapfile -t wheels < <(sed -n 's/^INSTALL //p' "$STATE/plan.txt")
  mapfile -t overlay < <(sed -n 's/^OVERLAY //p' "$STATE/plan.txt")
  local rc=0
  if [ "${#overlay[@]}" -gt 0 ]; then
    echo "+ pip install --target $STATE/overlay ${overlay[*]}"
    if [ "$DRY_RUN" != 1 ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --target "$STATE/overlay" "${overlay[@]}" || rc=1
      echo "$STATE/overlay" >"$STATE/pythonpath"
    fi
  fi
  if [ "${#wheels[@]}" -gt 0 ]; then
    echo "+ pip install --no-index --no-deps --force-reinstall --find-links $KIT ${wheels[*]}"
    if [ "$DRY_RUN" != 1 ]; then
      "$PY" -m pip install --no-index --no-deps --force-reinstall --no-cache-dir --find-links "$KIT" \
        "${wheels[@]}" || rc=1
    fi
  fi
  return "$rc"
}

check() {
  local rc=0
  torch_state >"$STATE/torch.after" || rc=1
  if cmp -s "$STATE/torch.before" "$STATE/torch.after"; then
    echo "torch unchanged: $(cat "$STATE/torch.after")"
  else
    echo "TORCH CHANGED: before '$(cat "$STATE/torch.before" 2>/dev/null)', after '$(cat "$STATE/torch.after")'"
    rc=1
  fi
  versions
  "$PY" - <<'EOF' || rc=1
import google.protobuf, grpc
print("grpc", grpc.__version__, grpc.__file__)
print("protobuf", google.protobuf.__version__, google.protobuf.__file__)
import grpc_health.v1.health_pb2_grpc, grpc_reflection.v1alpha.reflection, grpc_status.rpc_status
import weightsync.client, weightsync.engine, weightsync.server.app
print("weightsync imports:", weightsync.client.__file__)
EOF
  "$PY" -m pip check || echo "(pip check: informational, the run goes on)"
  return "$rc"
}

run_pytest() {
  # A communicator that never forms lingers this long in the tests' processes (torch reads it once).
  export TORCH_NCCL_NONBLOCKING_TIMEOUT=${TORCH_NCCL_NONBLOCKING_TIMEOUT:-20}
  export GPU_KIT_MEASURES="$OUT/measures.jsonl"
  # shellcheck disable=SC2086  # TESTS and GPU_KIT_PYTEST_ARGS are lists of arguments
  "$PY" -m pytest -q -rs -p no:cacheprovider --durations=15 $TESTS \
    --junitxml="$OUT/junit-gpu.xml" ${GPU_KIT_PYTEST_ARGS:-}
  local rc=$?
  [ -s "$GPU_KIT_MEASURES" ] && { echo "measures:"; cat "$GPU_KIT_MEASURES"; }
  return "$rc"
}

run_bench() {
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  "$PY" -m bench.gpu --out "$OUT" $BENCH_ARGS
}

export -f torch_state gpu_versions versions info stale install_kit check run_pytest run_bench
export DRY_RUN

# The limit of a step that may take up to $1 s: never more than what is left once $2 s are kept
# back for the steps after it.
upto() { min "$1" $(($(left) - $2)); }

main() {
  : >"$SUMMARY"
  echo "gpu-kit run: $(date -u +%FT%TZ), OUT=$OUT, python=$PY, kit=$KIT, budget ${TOTAL}s"
  timeout -k 5 "$INFO_S" bash -c gpu_versions >"$OUT/versions.txt" 2>&1 || echo "(unknown: see run.log)" >>"$OUT/versions.txt"
  echo "versions $(head -1 "$OUT/versions.txt")" | tee -a "$SUMMARY"
  # What pytest needs at least, and the bench, are kept back from the steps before them.
  local later=$((BENCH_S + 60))
  step info "$(upto "$INFO_S" "$later")" info
  if [ "$DRY_RUN" = 1 ]; then
    step plan "$(upto 60 "$later")" install_kit
  else
    step stale "$(upto 60 "$later")" stale
    step install "$(upto 90 "$later")" install_kit
    if [ -s "$STATE/pythonpath" ]; then
      PYTHONPATH="$(cat "$STATE/pythonpath")${PYTHONPATH:+:$PYTHONPATH}"
      export PYTHONPATH
      echo "PYTHONPATH=$PYTHONPATH (the kit's fallback grpcio/protobuf, this run only)"
    fi
    step check "$(upto 30 "$later")" check
    step pytest "$(upto "$PYTEST_S" "$((BENCH_S + 5))")" run_pytest
    step bench "$(upto "$BENCH_S" 2)" run_bench
  fi
  echo
  echo "=== summary ($SECONDS s, $failures failed) ==="
  cat "$SUMMARY"
  echo "files in $OUT:" "$OUT"/*
  return $((failures > 0))
}

main 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
rm -rf "$STATE"
exit "$rc"
