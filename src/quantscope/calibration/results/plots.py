"""Plots (matplotlib, the optional ``plot`` extra), in the format the file's extension names
(PNG where it names none).

* :func:`plot_histogram`: one layer's activation histogram on a log scale, with
  each observer's clipping range (the smallest and largest values its quantizer
  represents) marked.
* :func:`plot_sqnr`: SQNR per layer for each observer, one panel per recipe and role.

Both read the JSON report of a comparison (``report.json``), so ``quantscope plot``
redraws them without the model, and write through :func:`quantscope.exporters.atomic.atomic_file`
(``inputs``: the paths the caller read, never overwritten).
"""

from __future__ import annotations

import math
import os

__all__ = ["drawable_recipes", "figure", "histogram_choice", "histogram_layers", "pick_layer",
           "plot_histogram", "plot_sqnr", "report_recipes", "save_figure"]


def figure(**kwargs):
    """A matplotlib ``Figure`` of its own (``figsize``, ``dpi``): drawn without pyplot, so a
    plot changes neither the caller's backend nor pyplot's list of open figures."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'quantscope[plot]'") from None
    return Figure(**kwargs)


def save_figure(fig, path, inputs=(), dpi=None) -> str:
    """``fig`` at ``path``, in the format its extension names (``.png``, ``.svg``, ``.pdf``
    ...; PNG where it has none): drawn into a temporary file that then replaces ``path``, so
    a symlink there is replaced rather than written through, and ``path`` is never one of
    ``inputs`` (:func:`~quantscope.exporters.atomic.check_writable_target`)."""
    from ...exporters.atomic import atomic_file

    ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".") or "png"
    formats = fig.canvas.get_supported_filetypes()
    if ext not in formats:
        raise ValueError(f"plot: cannot write {os.fspath(path)!r}: its extension names no "
                         f"format matplotlib writes; expected one of {sorted(formats)}")
    with atomic_file(path, inputs=inputs) as tmp:
        fig.savefig(tmp, format=ext, dpi=dpi if dpi is not None else "figure")
    return path


def _short(layer: str) -> str:
    return (layer.replace("encoder.layer.", "L").replace("attention.self.", "")
            .replace("attention.output.dense", "attn.out").replace("intermediate.dense", "ffn.up")
            .replace("output.dense", "ffn.down"))


def report_recipes(report: dict) -> list[str]:
    """The recipes of a report's runs, in its order."""
    return list(dict.fromkeys(r["recipe"] for r in report["runs"].values() if r.get("recipe")))


def histogram_layers(report: dict, role: str = "input") -> list[str]:
    """The layers with a ``role`` activation histogram in a report."""
    return [k.rsplit("/", 1)[0] for k in report.get("histograms", {})
            if k.rsplit("/", 1)[1] == role]


def _drawable_rows(report: dict, role: str, recipe: str | None = None,
                   layer: str | None = None):
    """``(recipe, row)`` of each ``role`` row whose clipping range :func:`plot_histogram`
    draws: static (nvfp4's calibrated 'local' inputs count), of a layer with a histogram
    where the report has histograms; only ``recipe``'s and ``layer``'s where given."""
    drawable = set(histogram_layers(report, role)) if "histograms" in report else None
    for run in report["runs"].values():
        if recipe is not None and run.get("recipe") != recipe:
            continue
        for r in run["layers"]:
            if (r["role"] == role and r["dynamic"] is not True
                    and (layer is None or r["layer"] == layer)
                    and (drawable is None or r["layer"] in drawable)):
                yield run.get("recipe"), r


def drawable_recipes(report: dict, role: str = "input", layer: str | None = None) -> list:
    """The recipes with a static ``role`` clipping range to draw on a histogram (of ``layer``,
    where given), in the report's order: not a weight-only or dynamic-input one."""
    return list(dict.fromkeys(rec for rec, _ in _drawable_rows(report, role, layer=layer)))


def pick_layer(report: dict, role: str = "input", recipe: str | None = None) -> str | None:
    """The layer whose SQNR differs most between the observers of ``recipe`` (the one
    :func:`plot_histogram` draws: by default the first with a static ``role`` range to draw),
    where the choice matters most; a gap between recipes (int8 against fp8) is not a choice
    of observer. Where the report has histograms, only layers with a ``role`` one count
    (those :func:`plot_histogram` can draw); None if there is no such layer."""
    recipe = _drawn_recipe(report, recipe, role)
    spread = {}
    for _, r in _drawable_rows(report, role, recipe):
        if r["sqnr_db"] is not None:
            spread.setdefault(r["layer"], []).append(r["sqnr_db"])
    if not spread:
        return None
    return max(spread, key=lambda k: max(spread[k]) - min(spread[k]))


def _drawn_recipe(report: dict, recipe: str | None, role: str,
                  layer: str | None = None) -> str | None:
    """``recipe``, else the first in the report's order with a static ``role`` range to draw
    (of ``layer``, where given), not merely the first run's (a weight-only or dynamic-input
    recipe has none): recipes often share activation specs, so one recipe's ranges suffice."""
    if not report["runs"]:  # (else nothing said)
        raise ValueError("plot: the report has no runs: nothing to plot")
    if recipe is None:
        recipe = next(iter(drawable_recipes(report, role, layer)), None)
    return recipe


def histogram_choice(report: dict, role: str = "input", recipe: str | None = None,
                     layer: str | None = None) -> tuple[str, str | None]:
    """The layer and the recipe :func:`plot_histogram` draws: ``layer``, else
    :func:`pick_layer`'s; ``recipe``, else the first with a static ``role`` clipping range
    there. A ValueError naming why where there is none (no histogram of ``layer``, a recipe
    with no such range: weight-only, dynamic inputs, or all kept in float)."""
    recipes = report_recipes(report)
    if recipe is not None and recipe not in recipes:
        raise ValueError(f"plot: no run of recipe {recipe!r}; the report's recipes: {recipes}")
    if layer is not None and f"{layer}/{role}" not in report.get("histograms", {}):
        raise ValueError(f"plot: no {role} histogram for layer {layer!r}"
                         f"{_kept_out(report, layer, role)}; layers with one: "
                         f"{sorted(histogram_layers(report, role))}")
    have = drawable_recipes(report, role, layer)
    drawn = _drawn_recipe(report, recipe, role, layer)
    if drawn not in have:
        whose = f"recipe {recipe!r} has no" if recipe is not None else (
            f"none of the report's recipes ({', '.join(recipes)}) has a")
        where = f"of layer {layer!r}" if layer is not None else "of a layer with a histogram"
        raise ValueError(f"plot: {whose} static {role} clipping range {where} (weight-only, "
                         f"dynamic {role}s or kept in float)"
                         + (f"; recipes with one: {', '.join(have)}" if have else ""))
    layer = layer or pick_layer(report, role, drawn)
    if layer is None:  # a static row, but none with an SQNR to choose by
        raise ValueError(f"plot: no {role} SQNR of recipe {drawn!r} to choose the layer by: "
                         f"name one")
    _check_histogram(report["histograms"][f"{layer}/{role}"], f"{layer}/{role}")
    return layer, drawn


def _check_histogram(hist, key: str) -> None:
    """A ValueError naming ``histograms[key]`` unless it has counts (a non-empty list of
    non-negative numbers) over a finite ``lo <= hi``: a report edited or damaged by hand."""
    counts = hist.get("counts") if isinstance(hist, dict) else None
    ends = [hist.get(k) for k in ("lo", "hi")] if isinstance(hist, dict) else []
    if not (isinstance(counts, list) and counts and all(
            isinstance(c, int | float) and not isinstance(c, bool) and c >= 0 for c in counts)):
        raise ValueError(f"plot: histograms[{key!r}].counts must be a non-empty list of "
                         f"non-negative counts")
    if not (all(isinstance(e, int | float) and not isinstance(e, bool) and math.isfinite(e)
                for e in ends) and ends[0] <= ends[1]):
        raise ValueError(f"plot: histograms[{key!r}] needs finite 'lo' <= 'hi', got "
                         f"{ends if ends else hist!r}")


def _kept_out(report: dict, layer: str, role: str) -> str:
    """Why ``layer``'s ``role`` has no histogram where keep_float is the cause (it chooses
    after calibration, so a layer asked for up front may be gone): the runs that took it out
    of static quantization, in parentheses; else ''."""
    runs = [label for label, run in report["runs"].items()
            if f"{layer} {role}" in ((run.get("info") or {}).get("keep_float") or {}).get(
                "tensors", ())]
    return (f" (keep_float took it out of static quantization: {', '.join(runs)})" if runs
            else "")


def plot_histogram(report: dict, layer: str, path: str, role: str = "input",
                   recipe: str | None = None, *, inputs=()) -> str:
    """Histogram of ``layer``'s ``role`` activations with the clipping range of each run of
    ``recipe`` (by default the first recipe with one: :func:`histogram_choice`, whose
    ValueError says why none can be drawn)."""
    _, recipe = histogram_choice(report, role, recipe, layer)
    hist = report["histograms"][f"{layer}/{role}"]
    fig = figure(figsize=(8, 4.2), dpi=100)  # first: its ImportError names the extra
    import matplotlib

    counts = hist["counts"]
    n = len(counts)
    width = (hist["hi"] - hist["lo"]) / n
    centers = [hist["lo"] + (k + 0.5) * width for k in range(n)]
    ax = fig.subplots()
    ax.bar(centers, [max(c, 0.8) if c else 0 for c in counts], width=width, color="0.55",
           log=True, label="activations (sample)")
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    xs = [hist["lo"], hist["hi"]]
    # observers whose ranges coincide share one pair of lines and one legend entry, and every
    # entry states its range: a line drawn exactly under another is never a lost legend entry
    groups = {}
    for label, run in report["runs"].items():
        if recipe is not None and run.get("recipe") != recipe:
            continue
        row = next((r for r in run["layers"] if r["layer"] == layer and r["role"] == role), None)
        if row is None or row["dynamic"] is True:
            continue
        name = run.get("observer", label)
        if row["requested"] == "auto":
            name += f" (chose {row['observer']})"
        key = (float(f"{row['clip_lo']:.6g}"), float(f"{row['clip_hi']:.6g}"))
        groups.setdefault(key, []).append(name)
    for k, ((lo, hi), names) in enumerate(groups.items()):
        c = colors[k % len(colors)]
        style = ("-", "--", ":", "-.")[(k // len(colors)) % 4]
        ax.axvline(lo, color=c, ls=style, lw=1.4,
                   label=f"{' = '.join(names)}: [{lo:.4g}, {hi:.4g}]")
        ax.axvline(hi, color=c, ls=style, lw=1.4)
        xs += [lo, hi]
    pad = 0.03 * (max(xs) - min(xs))
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.set_xlabel("value")
    ax.set_ylabel("count (log)")
    ax.set_title(f"{recipe or ''} {_short(layer)} {role}: clipping range per observer",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return save_figure(fig, path, inputs)


def plot_sqnr(report: dict, path: str, *, inputs=()) -> str:
    """SQNR per layer for each observer: one panel per (recipe, role), each with its legend;
    a point sits at its layer's name (an observer without a row for a layer, e.g. one whose
    ``keep_float`` dropped it, leaves a gap there); observers whose SQNR coincides on every
    layer (weights that all take min-max) share one line labelled ``a = b``."""
    panels = {}
    for label, run in report["runs"].items():
        for r in run["layers"]:
            panels.setdefault((run.get("recipe", ""), r["role"]), {}).setdefault(
                run.get("observer", label), []).append(r)
    if not panels:  # e.g. a KV-cache-only recipe: its tensors are not sampled, no SQNR
        raise ValueError("plot: no run of the report has a layer row (an SQNR) to plot")
    order = list(dict.fromkeys(k[0] for k in panels))  # recipes in the report's order
    keys = sorted(panels, key=lambda k: (order.index(k[0]), {"weight": 0, "input": 1}.get(k[1], 2)))
    cols = len({k[1] for k in keys})
    rows = math.ceil(len(keys) / cols)
    fig = figure(figsize=(5.5 * cols, 3.2 * rows), dpi=100)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        layers = _merged_layers(panels[key].values())
        at = {name: k for k, name in enumerate(layers)}
        lines = {}  # observers with the same SQNR on every layer share one line and its label
        for obs, rr in panels[key].items():
            ys = [_GAP] * len(layers)
            for r in rr:
                v = r["sqnr_db"]
                ys[at[r["layer"]]] = _GAP if v is None or math.isnan(v) else v
            lines.setdefault(tuple(ys), []).append(obs)
        for ys, names in lines.items():
            ax.plot(range(len(ys)), ys, marker=".", lw=1, label=" = ".join(names))
        ax.legend(fontsize=7)
        ax.set_title(f"{key[0]} {key[1]}", fontsize=10)
        ax.set_ylabel("SQNR dB")
        step = max(1, len(layers) // 12)
        ax.set_xticks(range(0, len(layers), step))
        ax.set_xticklabels([_short(n) for n in layers[::step]], rotation=60, fontsize=8,
                           ha="right")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    return save_figure(fig, path, inputs)


#: a point not drawn; one object, so that equal lines (tuples holding it) are equal dict keys
_GAP = float("nan")


def _merged_layers(runs) -> list[str]:
    """The layers of every run's rows, each run's order kept: a layer the runs before lacked
    goes just before the next of its run's layers already placed (at the end if none)."""
    layers = []
    for rows in runs:
        at = len(layers)
        for r in reversed(rows):
            if r["layer"] in layers:
                at = layers.index(r["layer"])
            else:
                layers.insert(at, r["layer"])
    return layers
