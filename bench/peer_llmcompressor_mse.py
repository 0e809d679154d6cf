"""Run llm-compressor's MSE observer on a saved tensor, in the peer's own venv (bench-only).

    /work/benchenv/bin/python bench/peer_llmcompressor_mse.py IN.pt OUT.pt SPEC.json

SPEC: {"observer": "memoryless_mse", "num_bits": 4, "type": "int", "symmetric": true,
       "strategy": "channel", "group_size": null, "block_structure": null,
       "observer_kwargs": {}, "repeat": 3, "time": true}
Writes {"min_vals", "max_vals", "scale", "zero_point", "global_scale", "seconds"} to OUT
(seconds: median of ``repeat`` timed runs of observe + get_qparams, a fresh observer each).
Run as a child process so the caller can also read its peak RSS.
"""

import json
import statistics
import sys
import time

import torch


def main(inp, out, spec_path):
    from compressed_tensors.quantization.quant_args import QuantizationArgs
    from llmcompressor.observers import Observer

    spec = json.load(open(spec_path))
    x = torch.load(inp)
    args = QuantizationArgs(num_bits=spec["num_bits"], type=spec.get("type", "int"),
                            symmetric=spec["symmetric"], strategy=spec["strategy"],
                            group_size=spec.get("group_size"),
                            block_structure=spec.get("block_structure"),
                            observer=spec["observer"])

    def run():
        obs = Observer.load_from_registry(spec["observer"], base_name="weight", args=args.model_copy(deep=True),
                                          **spec.get("observer_kwargs", {}))
        obs(x)
        stats = {"min_vals": obs.min_vals.clone(), "max_vals": obs.max_vals.clone()}
        qp = obs.get_qparams()
        return stats, qp

    stats, qp = run()
    times = []
    if spec.get("time", True):
        for _ in range(spec.get("repeat", 3)):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    torch.save({**stats, "scale": qp["scale"], "zero_point": qp["zero_point"],
                "global_scale": qp.get("global_scale"),
                "seconds": statistics.median(times) if times else None}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
