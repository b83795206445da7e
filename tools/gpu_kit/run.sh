#!/usr/bin/env bash
# On the lent GPU machine, from the repo root, with .gpu-kit carried (make gpu-kit here first):
#
#   bash tools/gpu_kit/run.sh
#
# Steps, each recorded in $OUT/summary.txt; a step that fails or runs out of time does not stop
# the next one:
#   info      nvidia-smi, the interpreter, torch/grpcio/protobuf/numpy/numba versions, /dev/shm
#   stale     is the kit's weightsync wheel built from this tree? if not, rebuild it here
#   install   the kit's wheels the machine lacks (tools/gpu_kit/kit.py plan), pip --no-index
#             --no-deps into the machine's python; torch, grpcio and protobuf are never replaced
#             (a fallback grpcio/protobuf goes on PYTHONPATH for this run only if the machine's is
#             too old)
#   check     torch's version and CUDA unchanged, weightsync and the companions import, pip check
#   pytest    python3 -m pytest -q -rs -p no:cacheprovider tests/gpu  (junit: $OUT/junit-gpu.xml)
#   bench     python3 -m bench.gpu --out $OUT  (gpu_bench.json, gpu_bench.md)
# Files in $OUT: run.log (everything), summary.txt, junit-gpu.xml, gpu_bench.json, gpu_bench.md.
#
# Environment: OUT (default /tmp/gpu-kit-out), GPU_PY (python3), GPU_KIT (.gpu-kit),
# GPU_KIT_TOTAL_S (540: the whole run stays under the device's 600 s per command),
# GPU_KIT_PYTEST_S (340), GPU_KIT_BENCH_S (150), GPU_KIT_BENCH_ARGS (extra bench.gpu arguments),
# GPU_KIT_DRY_RUN=1 (info and the install plan only: installs nothing, runs nothing).
# Exit status: 0 when every step passed, 1 otherwise.

# shellcheck disable=SC2317  # the step functions run through `bash -c NAME` (export -f)
set -u
cd "$(dirname "$0")/../.." || exit 2

OUT=${OUT:-/tmp/gpu-kit-out}
PY=${GPU_PY:-python3}
KIT=${GPU_KIT:-.gpu-kit}
TOTAL=${GPU_KIT_TOTAL_S:-540}
PYTEST_S=${GPU_KIT_PYTEST_S:-340}
BENCH_S=${GPU_KIT_BENCH_S:-150}
DRY_RUN=${GPU_KIT_DRY_RUN:-0}
STATE=$(mktemp -d /tmp/gpu-kit-state.XXXXXX)
SUMMARY=$OUT/summary.txt
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
export OUT PY KIT STATE

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
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu --junitxml="$OUT/junit-gpu.xml"
}

run_bench() {
  # shellcheck disable=SC2086  # GPU_KIT_BENCH_ARGS is a list of arguments
  "$PY" -m bench.gpu --out "$OUT" ${GPU_KIT_BENCH_ARGS:-}
}

export -f torch_state versions info stale install_kit check run_pytest run_bench
export DRY_RUN

main() {
  : >"$SUMMARY"
  echo "gpu-kit run: $(date -u +%FT%TZ), OUT=$OUT, python=$PY, kit=$KIT, budget ${TOTAL}s"
  step info 60 info
  if [ "$DRY_RUN" = 1 ]; then
    step plan 60 install_kit
  else
    step stale 90 stale
    step install 120 install_kit
    if [ -s "$STATE/pythonpath" ]; then
      PYTHONPATH="$(cat "$STATE/pythonpath")${PYTHONPATH:+:$PYTHONPATH}"
      export PYTHONPATH
      echo "PYTHONPATH=$PYTHONPATH (the kit's fallback grpcio/protobuf, this run only)"
    fi
    step check 60 check
    step pytest "$(min "$PYTEST_S" $(($(left) - BENCH_S - 10)))" run_pytest
    step bench "$(min "$BENCH_S" $(($(left) - 5)))" run_bench
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
