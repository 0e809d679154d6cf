"""Reports: per layer and role, how well the calibrated quantizer represents the data.

For each quantized tensor (a weight, or a sample of the activations seen during
calibration): the SQNR ``10 log10(sum x^2 / sum (x - qdq(x))^2)`` in dB, the
fraction of values QDQ clamps (clipped: their rounded code is outside the range), the
observer's range and the observer used. Rows describe what ``apply`` runs: activations
``keep_float`` took out of static quantization have none (a "Fallback" table lists them);
the KV cache, which the pass does not sample, has a table of its own (spec, scale, range).
A summary averages over layers; tables print with ``rich`` when it is installed, else as
plain text, and save as markdown and JSON. A tensor QDQ leaves unchanged (all zero, or
every value exactly representable) has no quantization error: SQNR inf, which JSON cannot
hold (``sqnr_db`` null there, as every non-finite float), so its row says
``"sqnr_exact": true`` and a note lists those rows (:func:`exact_note`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ...observers.runtime import runtime_qparams
from ...qdq import _per_unit, clip_edges, fake_quantize, inside_range

__all__ = [
    "Report",
    "exact_note",
    "format_table",
    "json_safe",
    "json_text",
    "kv_cache_rows",
    "markdown_table",
    "print_table",
    "summarize",
    "tensor_stats",
    "write_text",
]


def tensor_stats(x: torch.Tensor, state) -> dict:
    """SQNR, clipped fraction and clipping range of ``x`` quantized by ``state`` (a RoleState)."""
    spec = state.spec
    qp = runtime_qparams(x, state)
    xf = x.detach().float()
    # one temporary of x's size at a time (a layer's weight is the largest tensor a
    # sequential run holds): the signal first, then the error in place on fake_quantize's
    # output (always fresh memory: quantize_units divides into a new tensor)
    signal = _square_sum(xf)
    noise = _square_sum(fake_quantize(x.detach(), qp, spec, check=False).float().sub_(xf))
    units = spec.layout.to_units(xf)
    lo_e, hi_e = clip_edges(qp, spec, units.shape[0])
    clipped = _clipped(units, qp, spec, x.shape)
    # one read back for all seven (each read waits for the device; float64 holds them exactly)
    signal, noise, clipped, clip_lo, clip_hi, x_min, x_max = torch.stack([
        t.double() for t in (signal, noise, clipped, lo_e.min(), hi_e.max(), *torch.aminmax(xf))
    ]).tolist()
    return {"sqnr_db": sqnr_db(signal, noise), "noise": noise, "signal": signal,
            "clipped": int(clipped) / max(x.numel(), 1), "clip_lo": clip_lo,
            "clip_hi": clip_hi, "min": x_min, "max": x_max,
            "units": int(units.shape[0]), "numel": int(x.numel())}


#: elements per float64 chunk of :func:`_square_sum` (32 MiB of float64 at a time)
_CHUNK = 1 << 22


def _square_sum(t: torch.Tensor) -> torch.Tensor:
    """``sum(t^2)`` in float64, squared in float64 too (a finite float32 value past ~1.8e19
    squares to inf in float32), a chunk at a time: never a float64 copy of all of ``t``."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in flat.split(_CHUNK):
        total += chunk.double().square_().sum()
    return total


def _clipped(units: torch.Tensor, qp, spec, shape) -> torch.Tensor:
    """How many of ``units`` QDQ clips (outside :func:`~quantscope.qdq.inside_range`)."""
    scale, zp = _per_unit(qp, spec, shape)
    return units.numel() - torch.count_nonzero(inside_range(units, scale, zp, spec))


def sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``; inf when there is no error, -inf for an all-zero signal."""
    if noise <= 0:
        return math.inf
    if signal <= 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def summarize(rows: list[dict]) -> dict:
    """Per role: mean / min SQNR (and the worst layer), mean clipped fraction, observers chosen."""
    out = {}
    for role in sorted({r["role"] for r in rows}):
        rr = [r for r in rows if r["role"] == role]
        finite = [r["sqnr_db"] for r in rr if math.isfinite(r["sqnr_db"])]
        worst = min(rr, key=lambda r: r["sqnr_db"])
        chosen = {}
        for r in rr:
            chosen[r["observer"]] = chosen.get(r["observer"], 0) + 1
        out[role] = {"layers": len(rr), "exact_layers": sum(_exact(r) for r in rr),
                     "mean_sqnr_db": sum(finite) / len(finite) if finite else math.inf,
                     "min_sqnr_db": worst["sqnr_db"], "worst_layer": worst["layer"],
                     "mean_clipped": sum(r["clipped"] for r in rr) / len(rr),
                     "observers": chosen}
    return out


def _exact(row: dict) -> bool:
    """Whether ``row``'s tensor has no quantization error at all (SQNR inf)."""
    return row["sqnr_db"] == math.inf


def exact_note(rows: list[dict]) -> str | None:
    """The note on the rows with no quantization error (SQNR inf: an all-zero tensor, or one
    whose every value the format holds exactly), listing them; None if there are none."""
    exact = [f"{r['layer']} {r['role']}" for r in rows if _exact(r)]
    if not exact:
        return None
    more = f" ... ({len(exact)} in all)" if len(exact) > 8 else ""
    return (f"SQNR inf (JSON: sqnr_db null, sqnr_exact true) means no quantization error: "
            f"zero or exactly representable: {', '.join(exact[:8])}{more}")


def _num(v, digits=2):
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v != 0 and (abs(v) < 10 ** -digits or abs(v) >= 1e6):
            return f"{v:.{digits}e}"
        return f"{v:.{digits}f}"
    return str(v)


def json_safe(obj):
    """``obj`` with non-finite floats as None and keys as strings (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def json_text(obj, **kwargs) -> str:
    """``obj`` as strict JSON text (RFC 8259 has no NaN / Infinity): :func:`json_safe`'s
    None for a non-finite float, and ``allow_nan=False`` so one that slips past it (in a
    type json_safe does not walk) is an error, never invalid JSON. ``kwargs``: json.dumps's."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """A plain-text table (columns padded to width)."""
    cells = [[_num(c) if not isinstance(c, str) else c for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h))
              for i, h in enumerate(headers)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))
    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells]
    return "\n".join(out)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    cells = [[_num(c) if not isinstance(c, str) else c for c in r] for r in rows]
    row = lambda r: "| " + " | ".join(_md_cell(c) for c in r) + " |"
    out = [row(headers), "|" + "|".join("---" for _ in headers) + "|"] + [row(r) for r in cells]
    return "\n".join(out)


def _md_cell(text: str) -> str:
    """``text`` in one table cell: a name's own ``|`` escaped, its line breaks written as
    ``\\n`` (a raw one would end the row)."""
    return text.replace("|", "\\|").replace("\r", "\\r").replace("\n", "\\n")


def print_table(headers: list[str], rows: list[list], title: str | None = None, file=None):
    """Print with rich if it is installed, else as plain text. Every string is rich ``Text``,
    never markup: a layer named ``proj[red]`` prints as named."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(format_table(headers, rows, title), file=file)
        return
    cells = [[_num(c) if not isinstance(c, str) else c for c in r] for r in rows]
    width = sum(max([len(h)] + [len(r[k]) for r in cells]) + 3 for k, h in enumerate(headers))
    table = Table(title=None if title is None else Text(title))
    for h in headers:
        table.add_column(Text(h), justify="left" if h in ("layer", "role", "observer", "recipe",
                                                    "spec") else "right")
    for r in cells:
        table.add_row(*map(Text, r))
    Console(file=file, width=max(80, width + 1)).print(table)


def write_text(path, text: str) -> None:
    """``text`` to ``path`` through :func:`~quantscope.exporters.atomic.atomic_file`: written
    whole or not at all, and a symlink at ``path`` replaced, never written through."""
    from ...exporters.atomic import atomic_file

    with atomic_file(path) as tmp, open(tmp, "w") as f:
        f.write(text)


LAYER_HEADERS = ["layer", "role", "observer", "SQNR dB", "clipped %", "lo", "hi", "units"]


def _layer_rows(rows):
    return [[r["layer"], r["role"], r["observer"], r["sqnr_db"], 100 * r["clipped"], r["lo"],
             r["hi"], r["units"]] for r in rows]


KV_HEADERS = ["layer", "role", "spec", "observer", "scale", "lo", "hi"]


def kv_cache_rows(states: dict) -> list[dict]:
    """The KV-cache tensors ``states`` quantizes (roles ``key`` / ``value``), one row each:
    spec, observer, scale and range. The pass does not sample the cache, so no SQNR."""
    from ..structure.kv_cache import ROLES

    rows = []
    for layer, roles in states.items():
        for role, st in roles.items():
            if role not in ROLES:
                continue
            scale = None if st.qparams is None else st.qparams.scale
            ends = {"scale_min": None if scale is None else scale.min(),
                    "scale_max": None if scale is None else scale.max(),
                    "lo": None if st.lo is None else st.lo.min(),
                    "hi": None if st.hi is None else st.hi.max()}
            known = {k: t for k, t in ends.items() if t is not None}
            if known:  # one read back for the row
                ends.update(zip(known, torch.stack([t.double() for t in known.values()])
                                .tolist()))
            rows.append({"layer": layer, "role": role, "spec": str(st.spec),
                         "observer": st.observer, "requested": st.requested,
                         "dynamic": st.dynamic, **ends})
    return rows


def _kv_cells(rows):
    def scale(r):
        if r["scale_min"] is None:
            return "per call"
        a, b = f"{r['scale_min']:.4g}", f"{r['scale_max']:.4g}"
        return a if a == b else f"{a} .. {b}"
    return [[r["layer"], r["role"], r["spec"], r["observer"], scale(r),
             "-" if r["lo"] is None else _num(r["lo"]), "-" if r["hi"] is None else _num(r["hi"])]
            for r in rows]


@dataclass
class Report:
    """The report of one calibration: ``rows`` (one per layer and role), summary, metrics;
    ``kv_cache`` the KV-cache tensors it quantizes (:func:`kv_cache_rows`: no SQNR) and
    ``notes`` what the report lacks and why (a loaded calibration: no statistics)."""

    label: str
    recipe: str
    rows: list[dict]
    metrics: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    kv_cache: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def summary(self) -> dict:
        """:func:`summarize` of ``rows``: per role, the layer count, mean / min SQNR in dB and
        the worst layer, the mean clipped fraction and ``{observer: layers}``."""
        return summarize(self.rows)

    def to_dict(self) -> dict:
        """Label, recipe, metrics, info, summary, ``layers`` (the rows, each with
        ``sqnr_exact``: true where SQNR is inf, no quantization error), kv_cache and notes,
        strict-JSON safe (:func:`json_safe`: non-finite floats as None)."""
        rows = [{**r, "sqnr_exact": _exact(r)} for r in self.rows]
        return json_safe({"label": self.label, "recipe": self.recipe, "metrics": self.metrics,
                           "info": self.info, "summary": self.summary, "layers": rows,
                           "kv_cache": self.kv_cache, "notes": self.notes})

    def to_json(self, path=None) -> str:
        """:meth:`to_dict` as JSON text (indent 1); also written to ``path`` if given."""
        text = json_text(self.to_dict(), indent=1)
        if path is not None:
            write_text(path, text + "\n")
        return text

    def summary_rows(self):
        """:attr:`summary` as table cells, one row per role, in ``SUMMARY_HEADERS`` order."""
        return [[role, s["layers"], s["mean_sqnr_db"], s["min_sqnr_db"], s["worst_layer"],
                 100 * s["mean_clipped"],
                 ", ".join(f"{k} {v}" for k, v in sorted(s["observers"].items()))]
                for role, s in self.summary.items()]

    SUMMARY_HEADERS: ClassVar[list[str]] = ["role", "layers", "mean SQNR dB", "min SQNR dB",
                                            "worst layer", "clipped %", "observers"]

    def to_markdown(self, path=None) -> str:
        """Notes, metrics, summary, layers and the extra tables (fusion groups, KV cache,
        fallback ...) as markdown; also written to ``path`` if given."""
        parts = [f"# quantscope report: {self.label}", ""]
        parts += [f"Note: {n}\n" for n in self.notes]
        if self.metrics:
            parts += [markdown_table(list(self.metrics), [self._metric_cells()]), ""]
        parts += ["## Summary", "", markdown_table(self.SUMMARY_HEADERS, self.summary_rows()),
                  "", "## Layers", "", markdown_table(LAYER_HEADERS, _layer_rows(self.rows)), ""]
        for title, headers, rows in self._sections():
            parts += [f"## {title}", "", markdown_table(headers, rows), ""]
        text = "\n".join(parts)
        if path is not None:
            write_text(path, text)
        return text

    def print(self, layers: bool = True, file=None) -> None:
        """Print the layer table (if ``layers``), summary, metrics, extra tables and notes to
        ``file`` (stdout by default), with rich where installed."""
        if layers:
            print_table(LAYER_HEADERS, _layer_rows(self.rows), f"{self.label}: layers", file)
        print_table(self.SUMMARY_HEADERS, self.summary_rows(), f"{self.label}: summary", file)
        if self.metrics:
            print_table(list(self.metrics), [self._metric_cells()], f"{self.label}: metrics",
                        file)
        for title, headers, rows in self._sections():
            print_table(headers, rows, f"{self.label}: {title}", file)
        for n in self.notes:
            print(f"{self.label}: note: {n}", file=file)

    def _sections(self):
        """Extra tables: from ``info`` fusion groups and MoE experts, the KV cache, from
        ``info`` again the activations ``keep_float`` took out of static quantization, the
        roles that saw no tokens and unreachable weights."""
        out = []
        if self.info.get("fusion_groups"):
            out.append(("Fusion groups", ["layers", "weight", "input"],
                        [[", ".join(g["layers"]), g["weight"], g["input"]]
                         for g in self.info["fusion_groups"]]))
        if self.info.get("experts"):
            out.append(("MoE experts", ["experts module", "expert", "tokens", "rule"],
                        [[e["module"], str(e["expert"]), str(e["tokens"]), e["rule"]]
                         for e in self.info["experts"]]))
        if self.kv_cache:
            out.append(("KV cache (not sampled: no SQNR)", KV_HEADERS, _kv_cells(self.kv_cache)))
        kept = self.info.get("keep_float")
        if kept and kept.get("tensors"):  # keep_float: taken out of the static rows above
            runs = {"float": "float", "dynamic": "dynamic (scales from each call)"}
            out.append(("Fallback (keep_float)", ["tensor", "runs"],
                        [[t, runs.get(kept["mode"], kept["mode"])] for t in kept["tensors"]]))
        if self.info.get("missing"):  # roles that saw no tokens: their fallback
            out.append(("Not observed (saw no tokens)", ["layer", "role", "calls", "runs"],
                        [[m["layer"], m["role"], str(m["calls"]), m["fallback"]]
                         for m in self.info["missing"]]))
        if self.info.get("unreached"):
            out.append(("Not quantized (unreachable)", ["weight", "why"],
                        [[u["name"], u["why"]] for u in self.info["unreached"]]))
        return out

    def _metric_cells(self) -> list[str]:
        return [f"{v:.4f}" if isinstance(v, float) else str(v) for v in self.metrics.values()]
