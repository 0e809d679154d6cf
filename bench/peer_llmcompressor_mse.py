"""llm-compressor's MSE observers on saved tensors, in the peer's own venv (bench / test only).

    .peers/bin/python bench/peer_llmcompressor_mse.py IN.pt OUT.pt CASES.json

IN.pt (or .safetensors): ``{name: tensor}``. CASES.json: a list of
``{"tensor": name, "observer": "memoryless_mse", "num_bits": 4, "type": "int",
"symmetric": true, "strategy": "channel", "group_size": null, "block_structure": null,
"scale_dtype": null, "observer_kwargs": {}}``. OUT.pt: a list of
``{"min_vals", "max_vals", "scale", "zero_point", "global_scale"}``, one per case.

``observe(x, case)`` is also what bench/mse_worker.py times against quantscope: one place
that says how llm-compressor's observer is built and called.
"""

import json
import sys

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


def run_case(x, case):
    (lo, hi), qp = observe(x, case)
    return {"min_vals": lo, "max_vals": hi,
            "scale": qp["scale"], "zero_point": qp["zero_point"],
            "global_scale": qp.get("global_scale")}


def main(inp, out, cases_path):
    if inp.endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(inp)
    else:
        tensors = torch.load(inp)
    with open(cases_path) as f:
        cases = json.load(f)
    torch.save([run_case(tensors[c["tensor"]], c) for c in cases], out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
