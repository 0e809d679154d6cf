#!/usr/bin/env bash
# The wheelhouse bench/gpu_check.sh carries to a lent GPU machine (which reaches no registry):
# llm-compressor 0.14 (the peer of issue 35's MSE rows and its oneshot in the whole-model row)
# and ModelOpt 0.47 (its fp8 scale sweep in the NVFP4 row), with what their imports need beyond
# the device image's packages (torch, transformers, accelerate, triton, scipy, rich, ninja,
# nvidia-ml-py, pandas, pyarrow ... are there: /work/.library/device/KINDS.md), at the
# versions .peers holds, --no-deps, for CPython 3.12 on x86-64. ModelOpt's import of its
# calibrator needs omegaconf (modelopt.torch.utils.robust_json) and pulp (modelopt.torch.opt
# .searcher) at module level; pulp's wheel carries its solver binaries (16 MB of the ~23). Run here, once, from the repo
# root: bash bench/gpu_wheels.sh   (writes .whl/, ignored through .git/info/exclude; the device
# tool carries it with carry=[".whl"]; 64 MiB at most with the rest of the tree).
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
py=${PYTHON:-.venv/bin/python}
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 pydantic==2.14.4 \
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 datasets==5.2.0 \
    dill==0.4.1 multiprocess==0.70.19 nvidia-modelopt==0.47.0 omegaconf==2.4.0 pulp==3.3.2
du -sh .whl
