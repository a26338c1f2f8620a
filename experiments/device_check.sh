#!/usr/bin/env bash
# The H200 device run, in one command, for a session that is lent a GPU (docs/kernels.md, "The H200 bench"):
# the kernel correctness tests, then experiments.bench_gpu with the four-layer slice, under a deadline so that
# one run takes at most 6 minutes and a 15-minute device session has room for a second run that resumes it.
#
#   bash experiments/device_check.sh OUT                     # e.g. the device tool's $OUT
#   RESUME=results/gpu_speed/YYYY-MM-DD SKIP_TESTS=1 bash experiments/device_check.sh OUT   # the second run
#
# OUT/ receives (7 files, one folder down, as the device tool returns them): environment.log, nvidia_smi.txt,
# kernel_tests.log, bench_gpu.log, and bench/results.json, bench/README.md (the generated table) and
# bench/h200_measured.md when the run is complete. Commit OUT/bench/* and the logs as
# results/gpu_speed/<the run's date>/; a second run resumes from that directory (RESUME) and adds the rows the
# first did not reach (bench_gpu --resume; "complete": true once every row is in).
#
# Time: tests ~70 s (6 xdist workers sharing the GPU), then the bench until BENCH_END_S (330 s) from the
# script's start: bench_gpu does not start a row whose estimated device time (compile + 21 calls at a
# pessimistic fraction of peak, bench_gpu.estimate_s) would end past its deadline, and `timeout` kills it at
# HARD_END_S (350 s) if an estimate was wrong (every finished row is already in results.json). Give the device
# tool's run a timeout_s of ~420 (machine start and transfers come on top).
#
# The lent image (/work/.library/device/KINDS.md) has jax 0.11.2 with the CUDA 13 plugin, flax, pytest and
# numpy, but not pyzmq or msgspec, which glm53 imports. Carry their wheels (and flax's if the image's is
# outside setup.py's range): once, in the repository root,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl pyzmq msgspec
# and name .whl in the tool's `carry`. This script installs whatever .whl (or $WHEELS) holds, only if an import
# fails, into /tmp/site.
set -u
OUT=${1:?usage: device_check.sh OUT}
mkdir -p "$OUT/bench"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BENCH_END_S=${BENCH_END_S:-330}
HARD_END_S=${HARD_END_S:-350}
status=0
step() {  # step NAME CMD...: run, log to OUT/NAME.log, remember the first failure
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 8 "$OUT/$name.log"
    echo "== $name: exit $rc ($SECONDS s since start)"
    [ "$status" -eq 0 ] && [ "$rc" -ne 0 ] && status=$rc
    return 0
}
if ! "$PY" -c "import zmq, msgspec" 2>/dev/null; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PY" -c "import zmq, msgspec" || { echo "pyzmq / msgspec missing: carry their wheels in $WHEELS (see above)"; exit 2; }
fi
nvidia-smi >"$OUT/nvidia_smi.txt" 2>&1
step environment "$PY" -c "import jax, flax, sys; print(sys.version); print(jax.__version__, flax.__version__, jax.devices())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    # the Pallas kernels compiled by XLA's Triton against their references (tests/conftest.py sets float32
    # matmuls to "highest"); no preallocation, so the xdist workers share the GPU
    step kernel_tests env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -q -p no:cacheprovider \
        -n "${KERNEL_WORKERS:-6}" tests/attention/test_kernels.py tests/attention/test_hisparse.py \
        tests/attention/test_merge.py tests/attention/test_fp8_gemm.py
fi
if [ -n "${RESUME:-}" ]; then
    cp "$RESUME/results.json" "$OUT/bench/results.json" || { echo "RESUME=$RESUME has no results.json"; exit 2; }
fi
deadline=$((BENCH_END_S - SECONDS))
# the slice (15 GB of weights, 25 GB of KV) and the largest kernel inputs side by side: let JAX's allocator
# take 90% of the GPU instead of its default 75%
# (BENCH_ARGS: e.g. "--dry-run --only linear" rehearses this script on a CPU machine in seconds)
step bench_gpu env XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}" PYTHONUNBUFFERED=1 \
    timeout --signal=TERM --kill-after=10 $((HARD_END_S - SECONDS)) \
    "$PY" -m experiments.bench_gpu --slice --out "$OUT/bench" --deadline-s "$deadline" --resume ${BENCH_ARGS:-}
# the README again from whatever results.json holds (a killed run did not write it), and the fit once complete
"$PY" -m experiments.bench_gpu --report "$OUT/bench" >/dev/null 2>&1
if "$PY" -c "import json, sys; sys.exit(0 if json.load(open('$OUT/bench/results.json'))['complete'] else 1)"; then
    "$PY" -m experiments.calibrate --measured "$OUT/bench" --no-register >>"$OUT/bench_gpu.log" 2>&1
    rm -f "$OUT/bench/h200_measured.json"  # regenerated when the run is committed (calibrate --measured)
fi
rm -f "$OUT/bench/results.json.tmp"  # a run killed while writing; results.json holds the rows before it
echo "== done in $SECONDS s, exit $status"
exit $status
