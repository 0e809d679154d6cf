"""Min-max observers against torch.ao and compressed-tensors / llm-compressor, and the floor.

Each case times, interleaved on the same tensor (bench/common.compare):

* quantscope ``memoryless_minmax``, ``static_minmax`` and ``minmax`` (EMA): one ``forward``
  (observe) and one ``forward`` + ``calculate_qparams``;
* torch.ao: the observer that does the same min / max work (``PerChannelMinMaxObserver`` on
  the layout's ``[units, elements]`` view; torch.ao has no group / token / block observers,
  so they are run on that view, which is how one would use torch.ao for them);
* llm-compressor: its memoryless min-max observer as 0.14 implements it (flatten for
  calibration, ``torch.amin`` / ``torch.amax`` over dims (0, -1), then compressed-tensors'
  ``calculate_qparams``, with ``generate_gparam`` for NVFP4); the installed
  llm-compressor observer itself when it is importable; per token, compressed-tensors'
  dynamic path (``compute_dynamic_scales_and_zp``: amin / amax over the last dim);
* the floor: ``torch.aminmax(x)`` over the whole tensor, one read of the same data.

The last cases repeat three in bf16, as an LLM's tensors come (quantscope reads them as they
are; the floor is ``torch.aminmax`` of the bf16 tensor).

``vs floor`` is quantscope's observe time over the floor (goal: <= 1.5); ``peer / qs`` is
the peer's time over quantscope's for the same work (observe, and observe + qparams).
"""

from __future__ import annotations

import os
import sys

import torch

import quantscope
from quantscope import Channel, Group, QuantSpec, Token, kernels, presets

try:
    from common import Table, compare
except ImportError:  # run from the repo root
    sys.path.insert(0, "bench")
    from common import Table, compare

FAMILIES = {"memoryless_minmax": {}, "static_minmax": {}, "minmax": {}}


def _ct():
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    except ImportError:
        return None
    try:
        from llmcompressor.observers import Observer as LCObserver
    except ImportError:
        LCObserver = None
    return QuantizationArgs, calculate_qparams, generate_gparam, LCObserver


def cases():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=g)
    a = torch.randn(16, 512, 4096, generator=g)
    wb, ab = w.bfloat16(), a.bfloat16()  # as an LLM's weights and activations come
    # name, tensor, quantscope spec, torch.ao view [units, elements], CT args, LC base name
    return [
        ("per-channel", w, QuantSpec("int8", Channel(0)), w,
         {"num_bits": 8, "strategy": "channel"}, "weight"),
        ("group-128", w, QuantSpec("int4", Group(128)), w.view(-1, 128),
         {"num_bits": 4, "strategy": "group", "group_size": 128}, "weight"),
        ("per-token", a, QuantSpec("int8", Token()), a.view(-1, 4096),
         {"num_bits": 8, "strategy": "token", "dynamic": True}, "input"),
        # E8M0 'even', as compressed-tensors rounds MX scales (the mxfp4 preset's 'floor' is
        # OCP's rule: the same work, other scales)
        ("MXFP4 block 32", w, QuantSpec("fp4_e2m1", presets.MXFP4.layout, scale="e8m0:even"),
         w.view(-1, 32),
         {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
          "scale_dtype": torch.uint8}, "weight"),
        ("NVFP4 block 16", w, presets.NVFP4, w.view(-1, 16),
         {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
          "scale_dtype": torch.float8_e4m3fn}, "weight"),
        ("per-channel bf16", wb, QuantSpec("int8", Channel(0)), wb,
         {"num_bits": 8, "strategy": "channel"}, "weight"),
        ("per-token bf16", ab, QuantSpec("int8", Token()), ab.view(-1, 4096),
         {"num_bits": 8, "strategy": "token", "dynamic": True}, "input"),
        ("NVFP4 block 16 bf16", wb, presets.NVFP4, wb.view(-1, 16),
         {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
          "scale_dtype": torch.float8_e4m3fn}, "weight"),
    ]


def ct_observer(ct, fields, base, x):
    """llm-compressor 0.14's memoryless min-max observer: (observe, observe + qparams)."""
    QuantizationArgs, calculate_qparams, generate_gparam, LCObserver = ct
    args = QuantizationArgs(**fields)
    strategy = args.strategy.value if hasattr(args.strategy, "value") else args.strategy
    if strategy == "token":  # dynamic per-token: compressed-tensors' compute_dynamic_scales_and_zp
        def observe_token():
            return torch.amin(x, dim=-1, keepdim=True), torch.amax(x, dim=-1, keepdim=True)

        return observe_token, lambda: calculate_qparams(*observe_token(), args)
    if LCObserver is not None:  # the real one
        def observe():
            obs = LCObserver.load_from_registry("memoryless_minmax", base_name=base,
                                                args=args.model_copy(deep=True))
            obs(x)
            return obs

        return observe, lambda: observe().get_qparams()
    if strategy == "channel":
        flat = x.unsqueeze(-2).unsqueeze(0)
    else:  # group, tensor_group
        flat = x.unflatten(-1, (-1, args.group_size)).unsqueeze(0)

    def observe():
        return torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1))

    def observe_qparams():
        lo, hi = observe()
        gs = generate_gparam(-torch.maximum(-lo.min(), hi.max()).reshape(1),
                             torch.maximum(-lo.min(), hi.max()).reshape(1)) \
            if strategy == "tensor_group" else None
        return calculate_qparams(lo, hi, args, global_scale=gs)

    return observe, observe_qparams


def main(repeat: int = 9, threads: int | None = None) -> None:
    """Print the table; ``threads`` (or env QUANTSCOPE_BENCH_THREADS; default 1) sets torch's
    threads."""
    # one thread unless told: stable ratios on a shared 2-core machine (as the other benches)
    threads = threads or int(os.environ.get("QUANTSCOPE_BENCH_THREADS") or 1)
    torch.set_num_threads(threads)
    ct = _ct()
    lc_name = "llm-compressor" if ct and ct[3] is not None else "llm-compressor (CT path)"
    print(f"compiled min/max kernel: {kernels.available('unit_minmax')}; threads {torch.get_num_threads()}; "
          f"peer: {lc_name if ct else 'compressed-tensors not installed'}\n")
    table = Table("min-max observers: median ms (observe / observe + qparams)",
                  ["case", "shape", "observer", "quantscope", "torch.ao", f"{lc_name}",
                   "floor", "vs floor", "torch.ao / qs", "llmc / qs"])
    for name, x, spec, view, fields, base in cases():
        fns = {"floor": lambda x=x: torch.aminmax(x)}
        obs = {}
        for fam, kw in FAMILIES.items():
            o = quantscope.get_observer(fam, spec, **kw)
            o(x)
            obs[fam] = o
            fns[f"{fam}"] = lambda o=o, x=x: o(x)
            fns[f"{fam}+qp"] = lambda o=o, x=x: (o(x), o.calculate_qparams())
        ao_dtype, ao_scheme = torch.qint8, torch.per_channel_symmetric
        ao = torch.ao.quantization.PerChannelMinMaxObserver(0, ao_dtype, ao_scheme)
        ao(view)
        fns["ao"] = lambda ao=ao, v=view: ao(v)
        fns["ao+qp"] = lambda ao=ao, v=view: (ao(v), ao.calculate_qparams())
        if ct is not None:
            fns["ct"], fns["ct+qp"] = ct_observer(ct, fields, base, x)
        t = compare(fns, repeat=repeat, warmup=2)
        ms = {k: v * 1e3 for k, v in t.items()}
        for fam in FAMILIES:
            q, qq = ms[fam], ms[f"{fam}+qp"]
            ct_cell = f"{ms['ct']:.2f} / {ms['ct+qp']:.2f}" if ct else "-"
            ct_ratio = f"{ms['ct'] / q:.1f} / {ms['ct+qp'] / qq:.1f}" if ct else "-"
            table.add(name, "x".join(map(str, x.shape)), fam, f"{q:.2f} / {qq:.2f}",
                      f"{ms['ao']:.2f} / {ms['ao+qp']:.2f}", ct_cell, f"{ms['floor']:.2f}",
                      f"{q / ms['floor']:.2f}", f"{ms['ao'] / q:.1f} / {ms['ao+qp'] / qq:.1f}",
                      ct_ratio)
        print(f"  {name}: done", flush=True)
    table.print()


if __name__ == "__main__":
    main()
