#!/usr/bin/env bash
# The H200 device check of the Pallas kernels, in one command, for the first session that is lent a GPU
# (docs/kernels.md). Each step runs even if an earlier one failed; the exit status is the first failure.
#
#   bash experiments/device_check.sh OUT_DIR        # e.g. the device tool's $OUT; ~5-8 minutes on an H200
#
# The two test runs (correctness: step 1 and the GPU-shaped tests) go first, side by side; then the timed
# steps, one at a time, alone on the GPU:
#
# 1. the kernel tests, now compiled by XLA's Triton and run on the GPU (not interpret mode), against the
#    references (tests/conftest.py sets float32 matmuls to "highest", so the references are not TF32);
# 2. bench_attention with the Pallas kernels and with the XLA references, 4K-128K contexts: per-step
#    times, achieved bytes/s and FLOP/s against the H200's 4.8 TB/s and 989 TFLOP/s;
# 3. check_hisparse_copy: only the selected rows cross from pinned host memory, the resolver kernel
#    agrees with its reference on the device, and both are timed at GLM-5.3's sizes;
# 4. check_engine_memory: the engine's pool leaves out the step workspace XLA reports; does it cover the
#    device's measured peak (experiments/check_engine_memory.py)?
# The lent image (/work/.library/device/KINDS.md) has jax 0.11.2 with the CUDA 13 plugin, flax, pytest,
# tqdm and matplotlib in its python3, but not pyzmq or msgspec (glm53 imports both): carry their wheels
# (and flax's, to match this project's version) and put them on PYTHONPATH first, as on 2026-12-04
# (results/device_check_2026-12-04/README.md).
# If step 1 passes, attention.common.PALLAS_VERIFIED_ON_GPU may be True (it is since the run of
# 2026-12-04, results/device_check_2026-12-04b); commit OUT_DIR under results/ with the date.
set -u
OUT=${1:?usage: device_check.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0
step() {  # step NAME CMD...: run, log to OUT/NAME.log, remember the first failure
    local name=$1; shift
    echo "== $name: $*"
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 5 "$OUT/$name.log"
    echo "== $name: exit $rc"
    [ "$status" -eq 0 ] && [ "$rc" -ne 0 ] && status=$rc
    return 0
}
step environment "$PY" -c "import jax, sys; print(sys.version); print(jax.__version__, jax.devices())"
rm -f "$OUT"/*.status "$OUT"/*.step  # a reused OUT_DIR: no stale status from an earlier run
# Correctness first, the two pytest runs side by side (xdist workers; the 15-minute lease is the limit):
# no preallocation, so the processes share the GPU. Their step() status is read back from files.
(
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    step kernel_tests "$PY" -m pytest -q -p no:cacheprovider -n "${KERNEL_WORKERS:-6}" \
        tests/attention/test_kernels.py tests/attention/test_hisparse.py tests/attention/test_merge.py \
        >"$OUT/kernel_tests.step" 2>&1
    echo $status >"$OUT/kernel_tests.status"
) &
(
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    # the GPU-shaped references against the CPU-shaped ones, and the engine's routing, on the GPU backend
    step gpu_shaped_tests "$PY" -m pytest -q -p no:cacheprovider -n "${SHAPED_WORKERS:-4}" \
        tests/attention/test_gpu_shaped.py >"$OUT/gpu_shaped_tests.step" 2>&1
    echo $status >"$OUT/gpu_shaped_tests.status"
) &
wait
for name in kernel_tests gpu_shaped_tests; do
    cat "$OUT/$name.step"
    rc=$(cat "$OUT/$name.status" 2>/dev/null || echo 1)
    [ "$status" -eq 0 ] && [ "$rc" -ne 0 ] && status=$rc
done
# Then the timed steps, one at a time, alone on the GPU.
step check_engine_memory "$PY" -m experiments.check_engine_memory --out "$OUT/check_engine_memory"
step bench_attention_pallas "$PY" -m experiments.bench_attention --impl pallas --repeats 20 \
    --out "$OUT/bench_attention_pallas"
step check_hisparse_copy "$PY" -m experiments.check_hisparse_copy --out "$OUT/check_hisparse_copy"
step bench_attention_reference "$PY" -m experiments.bench_attention --impl reference --repeats 20 \
    --out "$OUT/bench_attention_reference"
exit $status
