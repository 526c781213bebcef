#!/usr/bin/env bash
# The GPU checks in one run, for a node's first minutes or a short GPU lease:
#   1. `slimpack selftest --json`: every available attention backend against the fp32 reference
#      (bf16, KV prefix, GQA), DP-Merge's context-parallel path, training steps sliced vs whole
#      through the SlimPack schedule, slicing overhead (pass/fail checks);
#   2. benchmarks/gpu_anchors.py: the H100 cost model's GEMM, attention and layer predictions
#      against this GPU's measurements, torch's bottom-right causal paths, and megatron-fixed vs
#      slimpack training steps on one GPU (measurements);
#   3. `slimpack profile --kernels`: this GPU's GEMM and attention tables (kernels.json), which
#      `--cost-model OUT_DIR/kernels.json` prices plans with in place of the published tables.
# Usage: benchmarks/gpu_check.sh OUT_DIR   (the project and its dependencies importable)
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/nvidia_smi.txt"
timeout "${SELFTEST_TIMEOUT:-200}" python3 -m megatron_slimpack.apps.cli selftest --json \
    >"$out/selftest.json" 2>"$out/selftest.log"
echo "selftest exit $?"
grep -E "PASS|FAIL|ERROR|SKIP|MEASURED" "$out/selftest.log" | cut -c1-400
timeout "${ANCHORS_TIMEOUT:-300}" python3 "$here/benchmarks/gpu_anchors.py" --out "$out/gpu_anchors.json" \
    >/dev/null 2>"$out/gpu_anchors.log"
echo "gpu_anchors exit $?"
grep -E "^(environment|gemm|attention|layer|bottom-right|steps)" "$out/gpu_anchors.log" | cut -c1-600
timeout "${KERNELS_TIMEOUT:-200}" python3 -m megatron_slimpack.apps.cli profile --kernels --out "$out/kernels.json" \
    >"$out/kernels.txt" 2>"$out/kernels.log"
echo "profile --kernels exit $?"
cat "$out/kernels.txt"
