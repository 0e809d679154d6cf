"""The ranking :mod:`.sensitivity` makes: :class:`Sensitivity`, its table, JSON and plot.

Kept apart from the measures (:func:`~.sensitivity.measure`,
:func:`~.sensitivity.layer_sensitivity`) and the fallback (:func:`~.sensitivity.keep_float`)
that make and read it; :mod:`.sensitivity` re-exports it.
"""

from __future__ import annotations

import json
import numbers
import operator
from dataclasses import dataclass, field

from ..recipe import ROLES
from ..results.report import write_text
from ..structure.kv_cache import ROLES as KV_ROLES

__all__ = ["Sensitivity", "count_arg"]

#: the roles a ranking row can name: a layer's, an attention layer's KV cache
KNOWN_ROLES = ROLES + KV_ROLES


def count_arg(who: str, n, name: str = "n") -> int:
    """``n`` as an int, or ``ValueError`` naming ``who``'s ``name`` unless a non-negative
    integer (numpy's too; not a bool, nor a float, whose slice would fail in Python's words)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"{who}: {name} must be a non-negative integer, got {n!r}")
    return operator.index(n)


@dataclass
class Sensitivity:
    """Per (layer, role), the output divergence when only that tensor is quantized.

    ``rows`` are sorted most sensitive first, each ``{"rank", "layer", "role", "observer",
    "divergence"}``; ``info`` says the metric, forwards and seconds spent, and
    (``"convolutions"``) the layers ranked that are convolutions, whose activations
    ``[N, C, *spatial]`` have no tokens (:func:`~.sensitivity.keep_float` reads it), and
    (``"tied"``, :func:`~.output_sensitivity.measure`'s) the layers holding one weight: a
    tied tensor, measured once with all of them quantized, their rows that one divergence."""

    rows: list[dict]
    info: dict = field(default_factory=dict)

    def top(self, n: int, role: str | None = None) -> list[tuple[str, str]]:
        """The ``n`` most sensitive ``(layer, role)`` (of ``role`` only, if given: a role
        of :data:`KNOWN_ROLES`; one the ranking has no row of gives none)."""
        n = count_arg("Sensitivity.top", n)
        if role is not None and role not in KNOWN_ROLES:  # a misspelt role: not an empty list
            present = sorted({r["role"] for r in self.rows})
            raise ValueError(f"Sensitivity.top: role must be None or one of {KNOWN_ROLES} "
                             f"(this ranking's: {present}), got {role!r}")
        return [(r["layer"], r["role"]) for r in self.rows
                if role is None or r["role"] == role][:n]

    def to_markdown(self, path=None) -> str:
        """A metric / forwards / seconds line and the rows' markdown table; to ``path`` if given."""
        from ..results.report import markdown_table

        text = markdown_table(["rank", "layer", "role", "observer", "divergence"],
                              [[str(r["rank"]), r["layer"], r["role"], r["observer"],
                                f"{r['divergence']:.4g}"] for r in self.rows])
        tied = "".join(f"\n{' = '.join(h)}: one tied weight, measured once (its rows are that "
                       f"one divergence)" for h in self.info.get("tied", ()))
        text = (f"Sensitivity ({self.info.get('metric', '')}; {self.info.get('forwards', '?')} "
                f"forwards, {self.info.get('seconds', 0):.1f} s){tied}\n\n{text}\n")
        if path is not None:
            write_text(path, text)
        return text

    def to_dict(self) -> dict:
        """``{"info": info, "rows": rows}``: what :meth:`to_json` writes."""
        return {"info": self.info, "rows": self.rows}

    def to_json(self, path=None) -> str:
        """:meth:`to_dict` as JSON text (indent 1); also written to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            write_text(path, text)
        return text

    def plot(self, path, top: int = 40) -> None:
        """A horizontal bar chart of the ``top`` most sensitive tensors (log scale)."""
        from ..results.plots import figure

        rows = self.rows[:count_arg("Sensitivity.plot", top, "top")][::-1]
        fig = figure(figsize=(8, 0.22 * len(rows) + 1.2))
        ax = fig.subplots()
        colors = {"weight": "tab:blue", "input": "tab:orange", "output": "tab:green"}
        ax.barh(range(len(rows)), [max(r["divergence"], 1e-12) for r in rows],
                color=[colors.get(r["role"], "gray") for r in rows])
        ax.set_yticks(range(len(rows)), [f"{r['layer']} {r['role']}" for r in rows], fontsize=6)
        ax.set_xscale("log")
        ax.set_xlabel(f"output divergence ({self.info.get('metric', '')}), only this tensor "
                      f"quantized")
        save(fig, path)


def save(fig, path) -> None:
    from ..results.plots import save_figure

    fig.tight_layout()
    save_figure(fig, path, dpi=120)
