"""Element rounding and fake quantization against compressed-tensors and torchao.

Interleaved on the same 2048 x 4096 float32 weight (bench/common.compare), same qparams:

* rounding: quantscope's ``FloatFormat.round`` (bit-level, from the format's definition)
  against torch's own float8 casts (clamp + cast + cast back to float32, what compressed-
  tensors and torchao run for fp8), and fp4 against compressed-tensors' ``cast_to_fp4``
  (the CPU path of its fake quantization);
* fake_quantize: quantscope against compressed-tensors ``fake_quantize`` for int8
  per-channel, int4 group 128, fp8 per-channel, fp4 group 16 and NVFP4; MXFP8 / MXFP4
  against torchao ``MXTensor.to_mx(...).dequantize()`` (which also computes the scales, so
  quantscope's row includes its qparams too);
* the floor: ``(x * c).round_().mul_(c)``, the least a QDQ can do (one output, three passes).

``peer / qs`` is the peer's time over quantscope's; ``vs floor`` is quantscope's over the floor.
"""

from __future__ import annotations

import sys
import warnings

import torch

from quantscope import QuantSpec, fake_quantize, presets, qparams_from_range
from quantscope.formats import FP4_E2M1, FP8_E4M3, FP8_E5M2
from quantscope.layout import Channel, Group

try:
    from common import Table, compare
except ImportError:  # run from the repo root
    sys.path.insert(0, "bench")
    from common import Table, compare

ROWS, COLS = 2048, 4096


def _observe(x, spec):
    u = spec.layout.to_units(x)
    return qparams_from_range(u.amin(1), u.amax(1), spec).reshape(
        spec.layout.qparam_shape(x.shape))


def _peers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from compressed_tensors.quantization import QuantizationArgs
            from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fq
            from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
        except ImportError:
            QuantizationArgs = ct_fq = cast_to_fp4 = None
        try:
            from torchao.prototype.mx_formats.mx_tensor import MXTensor
        except ImportError:
            MXTensor = None
    return QuantizationArgs, ct_fq, cast_to_fp4, MXTensor


def main() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(ROWS, COLS, generator=g)
    QuantizationArgs, ct_fq, cast_to_fp4, MXTensor = _peers()
    floor_c = torch.tensor(0.37)

    def floor():  # one output allocation, three elementwise passes: the least QDQ can do
        return (w * floor_c).round_().mul_(floor_c)

    t = Table(f"element rounding, {ROWS}x{COLS} float32 (ms)",
              ["op", "quantscope", "peer", "peer / qs"])
    x8 = w * 100
    for f in (FP8_E4M3, FP8_E5M2):
        r = compare({"qs": lambda f=f: f.round(x8),
                     "cast": lambda f=f: x8.clamp(-f.max, f.max).to(f.torch_dtype).float()},
                    repeat=5)
        t.add(f"{f.name} round vs torch cast", r["qs"] * 1e3, r["cast"] * 1e3, r["cast"] / r["qs"])
    x4 = w * 3
    fns = {"qs": lambda: FP4_E2M1.round(x4)}
    if cast_to_fp4 is not None:
        fns["ct"] = lambda: cast_to_fp4(x4)  # it does not write its input: no clone to time
    r = compare(fns, repeat=5)
    t.add("fp4_e2m1 round vs CT cast_to_fp4", r["qs"] * 1e3, r.get("ct", float("nan")) * 1e3,
          r.get("ct", float("nan")) / r["qs"])
    t.print()

    t = Table(f"fake_quantize, {ROWS}x{COLS} float32 (ms)",
              ["scheme", "quantscope", "peer", "peer / qs", "floor", "qs vs floor"])
    cases = [
        ("int8 per-channel", QuantSpec("int8", Channel(0)),
         {"num_bits": 8, "strategy": "channel"}),
        ("int4 group128", presets.INT4_GROUP128, {"num_bits": 4, "strategy": "group",
                                                   "group_size": 128}),
        ("fp8 per-channel", presets.FP8_PER_CHANNEL,
         {"num_bits": 8, "type": "float", "strategy": "channel"}),
        ("fp4 group16", QuantSpec("fp4", Group(16)),
         {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}),
        ("nvfp4", presets.NVFP4, {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                  "group_size": 16, "scale_dtype": torch.float8_e4m3fn}),
    ]
    for name, spec, kw in cases:
        q = _observe(w, spec)
        fns = {"qs": lambda spec=spec, q=q: fake_quantize(w, q, spec), "floor": floor}
        if ct_fq is not None:
            args = QuantizationArgs(**kw)
            scale = q.scale.reshape(q.scale.shape[0], -1)
            zp = q.zero_point.reshape(scale.shape).to(torch.int8)
            fns["ct"] = lambda args=args, scale=scale, zp=zp, gs=q.global_scale: ct_fq(
                w, scale, zp, args, global_scale=gs)
        r = compare(fns, repeat=5)
        ct = r.get("ct", float("nan"))
        t.add(name, r["qs"] * 1e3, ct * 1e3, ct / r["qs"], r["floor"] * 1e3, r["qs"] / r["floor"])
    if MXTensor is not None:
        for name, spec, elem in (("mxfp8 (incl. scales)", presets.MXFP8, torch.float8_e4m3fn),
                                 ("mxfp4 (incl. scales)", presets.MXFP4, torch.float4_e2m1fn_x2)):
            def qs(spec=spec):
                return fake_quantize(w, _observe(w, spec), spec)

            def ao(elem=elem):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return MXTensor.to_mx(w, elem, block_size=32).dequantize(torch.float32)

            r = compare({"qs": qs, "ao": ao, "floor": floor}, repeat=5)
            t.add(name, r["qs"] * 1e3, r["ao"] * 1e3, r["ao"] / r["qs"], r["floor"] * 1e3,
                  r["qs"] / r["floor"])
    t.print()


if __name__ == "__main__":
    main()
