"""llm-compressor's MSE observers, built and called as its registry does, in the peers' venv
(bench / test only): one place that says how, for the benches that time them against
quantscope (bench/mse_worker.py, the GPU rows) and the differential test
(tests/compat/test_llmc_mse_differential.py).

A case: ``{"observer": "memoryless_mse", "num_bits": 4, "type": "int", "symmetric": true,
"strategy": "channel", "group_size": null, "block_structure": null, "scale_dtype": null,
"observer_kwargs": {}}``.
"""

import torch


def quant_args(case):
    from compressed_tensors.quantization.quant_args import QuantizationArgs

    return QuantizationArgs(num_bits=case["num_bits"], type=case.get("type", "int"),
                            symmetric=case.get("symmetric", True), strategy=case["strategy"],
                            group_size=case.get("group_size"),
                            block_structure=case.get("block_structure"),
                            scale_dtype=(getattr(torch, case["scale_dtype"])
                                         if case.get("scale_dtype") else None),
                            observer=case["observer"])


def weight_observer(case, args=None):
    """llm-compressor's weight observer of ``case``, as its registry builds it."""
    from llmcompressor.observers import Observer

    args = quant_args(case) if args is None else args
    return Observer.load_from_registry(case["observer"], base_name="weight",
                                       args=args.model_copy(deep=True),
                                       **case.get("observer_kwargs", {}))


def search(obs, x):
    """``obs``'s search alone on ``x`` (a weight observer keeps its first statistics: they
    go first): ``(min_vals, max_vals)``."""
    obs.delete_statistics(check_fused=False)
    obs(x)
    return obs.min_vals, obs.max_vals


def observe(x, case, args=None):
    """A fresh llm-compressor observer fed ``x`` once: (min_vals, max_vals), qparams.

    What one weight costs; the statistics are read before ``get_qparams``, which deletes them.
    """
    obs = weight_observer(case, args)
    obs(x)
    stats = obs.min_vals, obs.max_vals
    return stats, obs.get_qparams()
