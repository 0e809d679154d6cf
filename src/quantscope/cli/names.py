"""The names the CLI accepts and its defaults, known without importing torch (so ``--help``
and a typo answer at once); tests/cli/test_cli_names.py holds each list equal to its
registry."""

from __future__ import annotations

from .._plainchecks import DEMO_MODEL_NAMES

RECIPE_NAMES = ("w8a8", "w8a8-dynamic", "w4a16", "w4a16-asym", "w4a8", "fp8", "fp8-dynamic",
                "mxfp4", "nvfp4", "fp8-kv")
KV_CACHE_NAMES = ("fp8",)
SCHEME_NAMES = ("FP8", "FP8_BLOCK", "FP8_DYNAMIC", "INT8", "MXFP4", "MXFP4A16", "MXFP4XFP8",
                "MXFP6A16", "MXFP6A8", "MXFP8", "MXFP8A16", "NVFP4", "NVFP4A16", "W2A16", "W2A4",
                "W2A8", "W3A16", "W3A4", "W3A8", "W4A16", "W4A16_ASYM", "W4A4", "W4A8", "W4AFP8",
                "W5A16", "W5A8", "W6A16", "W6A8", "W7A16", "W7A8", "W8A16", "W8A8")
OBSERVER_NAMES = (
    "auto", "entropy", "fouroversix", "histogram", "histogram_mse", "horizon:KLObserver",
    "horizon:MSEObserver", "horizon:MinMaxObserver", "horizon:MixObserver",
    "horizon:MovingAverageMinMaxObserver", "horizon:MovingAveragePerChannelMinMaxObserver",
    "horizon:PercentileObserver", "horizon_mse", "imatrix_mse", "kl", "l2_histogram", "linear_mse",
    "llmcompressor:memoryless_minmax", "llmcompressor:memoryless_mse", "llmcompressor:minmax",
    "llmcompressor:mse", "llmcompressor:nvfp4_expanded_mse", "llmcompressor:static_minmax",
    "memoryless_minmax", "memoryless_mse", "minmax", "mix", "modelopt:HistogramCalibrator",
    "modelopt:MaxCalibrator", "moving_average_minmax", "moving_average_mse", "mse",
    "nvfp4_expanded_mse", "percentile", "placeholder", "pow2_mse",
    "quark:PerBlockBFPObserver", "quark:PerBlockMXObserver", "quark:PerChannelMinMaxObserver",
    "quark:PerGroupMinMaxObserver", "quark:PerTensorHistogramObserver",
    "quark:PerTensorHistogramObserverPro", "quark:PerTensorMSEObserver",
    "quark:PerTensorMinMaxObserver", "quark:PerTensorPercentileObserver",
    "quark:PlaceholderObserver", "quark:UniformScalingObserver", "static_minmax",
    "torch.ao:HistogramObserver", "torch.ao:MinMaxObserver",
    "torch.ao:MovingAverageMinMaxObserver", "torch.ao:MovingAveragePerChannelMinMaxObserver",
    "torch.ao:PerChannelMinMaxObserver")
TASKS = ("causal-lm", "embedding")
#: the demo models' ``--model`` names (a folder of that name that exists is that folder:
#: ``_plainchecks.demo_model_name``)
DEMO_MODELS = DEMO_MODEL_NAMES
DEFAULT_OBSERVERS = "minmax,mse,percentile,entropy,mix,auto"
#: the modules a preset or scheme quantizes unless --targets says otherwise (a recipe file's
#: rules name their own)
DEFAULT_TARGETS = ("Linear",)
#: left in float unless --ignore says otherwise: the output head and the pooler (unused by
#: mean-pooled embeddings), as the peers' recipes leave them; embeddings are not Linear
DEFAULT_IGNORE = ["*pooler*", "*lm_head*"]
