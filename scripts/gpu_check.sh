#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a machine that has one (CUDA + torch +
# triton + pytest, no venv, no jupyter): run from the repository root as
#     bash scripts/gpu_check.sh [OUT_DIR]
# 1. kernel tests compiled for the GPU (the interpreter is not used when CUDA is present),
# 2. the model's paged-vs-contiguous check and the NCCL context-parallel test (these two test
#    files import hypothesis: where it is missing, install its pure-Python wheel first, e.g.
#    `pip install --target /tmp/site hypothesis` and `export PYTHONPATH=/tmp/site:.`),
# 3. bench/kernels.py, which writes bench/results/kernels_<gpu>.json for chapter 04.
# Everything is logged to OUT_DIR (default: bench/results) so the figures can be committed.
set -uo pipefail
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-.}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/gpu.txt"
status=0
python3 -m pytest -q tests/test_kernels.py tests/test_kernels_reference.py tests/test_cache_ops.py \
    tests/test_kernels_ch04.py tests/test_aot_hopper.py 2>&1 | tee "$out/gpu_kernel_tests.log" \
    || status=1
if python3 -c "import hypothesis" 2>/dev/null; then
    python3 -m pytest -q -m gpu tests/test_model.py tests/test_parallel_cp.py 2>&1 \
        | tee "$out/gpu_model_cp_tests.log" || status=1
else
    echo "hypothesis missing: skipped tests/test_model.py and tests/test_parallel_cp.py" \
        | tee "$out/gpu_model_cp_tests.log"
fi
python3 bench/kernels.py 2>&1 | tee "$out/gpu_bench_kernels.log" || status=1
cp bench/results/kernels_*.json "$out/" 2>/dev/null || true
exit $status
