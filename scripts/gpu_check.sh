#!/usr/bin/env bash
# Every check that needs a GPU, as one prepared script (about 10 minutes on an H100/H200), for a
# machine with CUDA, torch, triton and pytest (no venv needed). From the repository root:
#     bash scripts/gpu_check.sh [OUT_DIR]
#  1. the kernel tests, compiled for the GPU (the interpreter is not used when CUDA is present),
#     and the ahead-of-time check (python -m course_lib.kernels.aot) on the same Triton;
#  2. the model and the engine on CUDA, context parallelism over NCCL, and P/D disaggregation
#     with its engines on CUDA (tests marked gpu; the NCCL tests need two GPUs and say so on one:
#     on one GPU the P/D engines share it and their K/V goes over gloo through CPU memory);
#  3. nbval of every notebook under the compiled backend (the stored outputs must not depend on
#     the backend: see COURSE_BACKEND in README.md);
#  4. bench/kernels.py --tiles: HBM bandwidth and paged/contiguous time for the large case, the
#     batch x context sweep, and the tile x stages x warps sweep with the best launch per shape,
#     saved to bench/results/kernels_<gpu>.json (chapter 04 shows it).
# Each step has its own time limit and its log in OUT_DIR (default bench/results/gpu/); the
# script goes on after a failed step and exits 1 if any failed.
#
# Python packages the steps import beyond torch/triton/pytest (hypothesis, nbval, ipykernel,
# matplotlib, ipywidgets, tqdm, prometheus_client, transformers): where they are missing and the
# machine is offline, put their wheels in build/wheels first (on a connected machine:
# `pip download -d build/wheels hypothesis nbval ipykernel ipywidgets matplotlib tqdm
# prometheus_client transformers --python-version 3.X --only-binary=:all:`) and the script
# installs them from there (WHEELS=DIR to use another folder).
set -uo pipefail
out="${1:-bench/results/gpu}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-.}"
export PYTHONUNBUFFERED=1
wheels="${WHEELS:-build/wheels}"
start=$(date +%s)
status=0

step() {   # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 5 "$out/$name.log"
    echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s" | tee -a "$out/summary.txt"
    [ $rc -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/gpu.txt"
: >"$out/summary.txt"
missing=$(python3 - <<'EOF'
import importlib.util
need = ["hypothesis", "nbval", "ipykernel", "ipywidgets", "matplotlib", "tqdm",
        "prometheus_client", "transformers"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
    if [ -d "$wheels" ]; then
        echo "installing from $wheels: $missing"
        python3 -m pip install -q --no-index --find-links "$wheels" $missing \
            || echo "could not install all of: $missing"
    else
        echo "missing Python packages: $missing (no wheels in $wheels): the steps that need"
        echo "them will fail and say so"
    fi
fi

step kernel_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    tests/test_kernels_reference.py tests/test_cache_ops.py tests/test_kernels_ch04.py \
    tests/test_aot_hopper.py tests/test_attn_backends.py tests/test_kernels_window.py
# the Triton exercises (0.x, 4.x) compiled: solutions pass, wrong kernels and torch answers fail
step triton_exercises 240 python3 -m pytest -q -p no:cacheprovider tests/test_exercises.py \
    tests/test_exercises_ch00.py tests/test_exercises_ch04.py -k "0. or 4. or ch00 or ch04"
step model_engine_cp_tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/test_model.py tests/test_engine.py tests/test_parallel_cp.py tests/test_disagg.py \
    tests/test_hybrid_model.py tests/test_hybrid_engine.py
step notebooks_nbval 420 python3 -m pytest -q -p no:cacheprovider notebooks --nbval \
    --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 300
step bench_kernels 300 python3 bench/kernels.py --tiles
cp bench/results/kernels_*.json "$out/" 2>/dev/null || true
echo "total $(( $(date +%s) - start ))s; logs in $out" | tee -a "$out/summary.txt"
exit $status
