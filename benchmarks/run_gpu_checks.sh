#!/usr/bin/env bash
# One prepared run of the GPU tests and GPU benchmarks, for a machine with a CUDA device where `python3` has
# torch and triton. Writes env.txt, tests.log, bench.log and the benchmark's gpu_kernels.{md,json} to $OUT.
#
#     OUT=gpu_out bash benchmarks/run_gpu_checks.sh
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
    echo "cores: $(nproc); gcc: $(gcc --version 2>/dev/null | head -1)"
} 2>&1 | tee "$OUT/env.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider --maxfail=20 -rs tests/test_native_gpu.py tests/test_kernels.py 2>&1 |
    tee "$OUT/tests.log"
timeout 300 python3 benchmarks/bench_gpu_kernels.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
