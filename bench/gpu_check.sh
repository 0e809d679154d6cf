#!/usr/bin/env bash
# One run on a lent CUDA machine (issues 19 and 35). Issue 35 first: bench/gpu_triton.py
# (every row of issue 35's table: the ops against one torch.aminmax, the peers' GPU paths, the
# whole model; tables for docs/benchmarks.md), then the Triton kernels' tests compiled on the
# GPU (tests/kernels/test_triton_*.py: bitwise against the torch path, opcheck on CUDA; the
# observers, the MSE engine and the block qparams on CUDA against the CPU's, a CUDA graph
# replay). The table first: it is what only a GPU run can give, and each test's kernel
# variants compile there, so the tests are the step a short device call may cut.
# Then issue 19's: every CUDA test, and bench_cuda.py. Needs python with torch (CUDA), triton,
# pytest and hypothesis (the device image has them); quantscope from this checkout, C kernels
# built here. llm-compressor comes from the wheelhouse .whl/ when present (bench/gpu_wheels.sh
# makes it here; the device tool carries it with carry=[".whl"]).
# Logs and results are written under $WORK (default /tmp/gpu-check) and packed after each step
# into $OUT/check.tgz (the device tool brings back 8 files at most; one archive brings back
# everything a step finished, even where a later step is cut): the benches' results, under
# bench/run.py's header, are results/{gpu,cuda}.txt there: copy them into bench/results/, then
# `make bench-docs`.
# Usage: bash bench/gpu_check.sh
# STEPS picks the steps, in this order: bench35, diag, host, triton (issue 35's, the default;
# on the H200 of 2026-12-04 bench35 took 141 s; diag and host, where the device's and the
# host's time goes (bench/gpu_profile.py: profiler tables, also by Python call site;
# bench/gpu_host.py: the host's time per call of each step of the min-max path;
# bench/host_ops.py: the ops each dispatches), about 40 s each; the triton tests run on 8
# processes (pytest-xdist, in the device image)), hist (the histogram binning variants of
# bench/gpu_hist_variants.py), cuda, bench19 (issue 19's: up to 7.5 more minutes).
set -uo pipefail
out=${WORK:-/tmp/gpu-check}
mkdir -p "$out" "${OUT:=$out/packed}"
pack() { tar -czf "$OUT/check.tgz" -C "$out" --exclude=packed . ; }
py=${PYTHON:-python3}
steps=",${STEPS:-bench35,diag,host,triton},"
site=/tmp/gpu-check-site
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl 2>&1 | tail -3
fi
export PYTHONPATH="$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}:$site" PYTHONUNBUFFERED=1
# the device reaches no hub: nothing may wait on one (the model is built from a config)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  "$py" -c "import platform, torch; print('python', platform.python_version(), 'torch',
torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name()
if torch.cuda.is_available() else 'no CUDA')
import importlib.util as u
for m in ('triton', 'llmcompressor', 'compressed_tensors'):
    print(m, __import__(m).__version__ if u.find_spec(m) else 'absent')"
} 2>&1 | tee "$out/env.log"
"$py" -m quantscope.kernels 2>&1 | tail -2
if [[ $steps == *,bench35,* ]]; then
    timeout "${BENCH35_TIMEOUT:-360}" "$py" bench/run.py --results "$out/results" gpu 2>&1 \
        | tee "$out/gpu_triton.log"
fi
pack
if [[ $steps == *,diag,* ]]; then  # where the slow rows' time goes (issue 35's next step)
    timeout "${DIAG_TIMEOUT:-90}" "$py" bench/gpu_profile.py "$out/prof" 2>&1 | tail -4
    pack
fi
if [[ $steps == *,host,* ]]; then
    timeout "${DIAG_TIMEOUT:-90}" "$py" bench/gpu_host.py "$out/host" 2>&1 | tail -16
    mkdir -p "$out/host"
    timeout "${DIAG_TIMEOUT:-90}" "$py" bench/host_ops.py --device cuda > "$out/host/ops.md" 2>&1
    tail -12 "$out/host/ops.md"
    pack
fi
if [[ $steps == *,hist,* ]]; then
    timeout "${DIAG_TIMEOUT:-90}" "$py" bench/gpu_hist_variants.py "$out/results/hist_variants.md" \
        2>&1 | tail -14
fi
if [[ $steps == *,triton,* ]]; then
    timeout "${TRITON_TIMEOUT:-240}" "$py" -m pytest -p no:cacheprovider -rs -n "${JOBS:-8}" \
        tests/kernels/test_triton_kernels.py tests/kernels/test_triton_block_search.py \
        tests/kernels/test_triton_ops.py tests/kernels/test_triton_large.py \
        tests/kernels/test_triton_weighted.py tests/kernels/test_triton_minmax_observe.py \
        tests/kernels/test_mse_ops_engine.py tests/observers/test_device_ops.py \
        tests/observers/test_grouped.py tests/calibrate/test_grouped_weights.py \
        tests/calibrate/test_device_pass.py tests/compat/test_torch_ao_exact.py \
        tests/core/test_qparams_ops.py tests/estimators/test_weighted.py \
        tests/compat/test_ao_histogram.py 2>&1 \
        | tee "$out/triton_tests.log" | tail -15
    pack
fi
# test files that import a package absent there (the peers, the demo data) fail to collect:
# the others still run
if [[ $steps == *,cuda,* ]]; then
    timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest tests -p no:cacheprovider -rs \
        --continue-on-collection-errors -k "cuda or gpu or device" 2>&1 \
        | tee "$out/tests.log" | tail -25
fi
if [[ $steps == *,bench19,* ]]; then
    timeout "${BENCH_TIMEOUT:-150}" "$py" bench/run.py --results "$out/results" cuda 2>&1 \
        | tee "$out/bench_cuda.log"
fi
pack
