"""``quantscope formats``: the demo's synthetic table of formats (min-max qparams)."""

from __future__ import annotations


def add_formats_parser(sub) -> None:
    sub.add_parser("formats", help="the synthetic format table (quantscope.demo)",
                   description="Print the synthetic table of formats: the error of each format "
                   "and granularity on three seeded tensors, with min-max qparams (no "
                   "observer or search).")


def cmd_formats(args) -> int:
    from ..demo.formats import format_table

    print(format_table())
    return 0
