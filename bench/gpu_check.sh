#!/usr/bin/env bash
# Issue 19 item 5 on a CUDA machine, in one run: every CUDA test (observers on the device with
# no host sync in forward and the CPU's qparams, calibration and auto on CUDA), then
# bench_cuda.py (the torch paths against the device's bandwidth floor). Needs python with
# torch (CUDA), pytest and hypothesis; quantscope from this checkout, kernels built here.
# Logs go to $OUT (default /tmp/gpu-check). Usage: bash bench/gpu_check.sh
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD/bench" PYTHONUNBUFFERED=1
{ nvidia-smi -L; nproc; "$py" -c "import platform, torch; print('python', platform.python_version(),
'torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
} 2>&1 | tee "$out/env.log"
"$py" -m quantscope.kernels 2>&1 | tail -2
# test files that import a package absent there (the peers, the demo data) fail to collect:
# the others still run
timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest tests -p no:cacheprovider -rs \
    --continue-on-collection-errors -k "cuda or gpu or device" 2>&1 | tee "$out/tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-150}" "$py" bench/bench_cuda.py 2>&1 | tee "$out/bench_cuda.log"
