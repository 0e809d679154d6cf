"""Run llm-compressor's MSE observers on saved tensors, in the peer's own venv (bench / test only).

    /work/benchenv/bin/python bench/peer_llmcompressor_mse.py IN.pt OUT.pt CASES.json

IN.pt: ``{name: tensor}``. CASES.json: a list of
``{"tensor": name, "observer": "memoryless_mse", "num_bits": 4, "type": "int",
"symmetric": true, "strategy": "channel", "group_size": null, "block_structure": null,
"observer_kwargs": {}, "repeat": 0}``. OUT.pt: a list of
``{"min_vals", "max_vals", "scale", "zero_point", "global_scale", "seconds"}`` (seconds: the
median of ``repeat`` timed runs of observe + get_qparams with a fresh observer each; None
when repeat is 0; peak_rss_growth_kb: peak RSS during the first run minus the RSS before it). Run it as a child process so the caller can read its peak RSS too.
"""

import json
import resource
import statistics
import sys
import time

import torch


def _current_rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


def run_case(x, case):
    if case["observer"] == "none":  # a baseline for peak RSS: imports and inputs only
        from llmcompressor.observers import Observer

        float(x.sum())
        return {}
    from compressed_tensors.quantization.quant_args import QuantizationArgs
    from llmcompressor.observers import Observer

    args = QuantizationArgs(num_bits=case["num_bits"], type=case.get("type", "int"),
                            symmetric=case.get("symmetric", True), strategy=case["strategy"],
                            group_size=case.get("group_size"),
                            block_structure=case.get("block_structure"),
                            scale_dtype=(getattr(torch, case["scale_dtype"])
                                         if case.get("scale_dtype") else None),
                            observer=case["observer"])

    def once():
        obs = Observer.load_from_registry(case["observer"], base_name="weight",
                                          args=args.model_copy(deep=True),
                                          **case.get("observer_kwargs", {}))
        obs(x)
        stats = {"min_vals": obs.min_vals.clone(), "max_vals": obs.max_vals.clone()}
        return stats, obs.get_qparams()

    float(x.sum())  # page the input in
    rss0 = _current_rss_kb()
    stats, qp = once()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(case.get("repeat", 0)):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return {**stats, "scale": qp["scale"], "zero_point": qp["zero_point"],
            "global_scale": qp.get("global_scale"),
            "seconds": statistics.median(times) if times else None,
            "peak_rss_growth_kb": rss1 - rss0}


def main(inp, out, cases_path):
    if inp.endswith(".safetensors"):  # mmap-backed: loading does not raise the peak RSS
        from safetensors.torch import load_file

        tensors = load_file(inp)
    else:
        tensors = torch.load(inp)
    with open(cases_path) as f:
        cases = json.load(f)
    results = [run_case(tensors[c["tensor"]], c) for c in cases]
    if results:
        results[-1]["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
