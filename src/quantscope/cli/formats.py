"""``quantscope formats``: the demo's synthetic table of formats and observers."""

from __future__ import annotations


def add_formats_parser(sub) -> None:
    sub.add_parser("formats", help="the synthetic format table (quantscope.demo)",
                   description="Print the synthetic table of formats and observers.")


def cmd_formats(args) -> int:
    from ..demo.formats import format_table

    print(format_table())
    return 0
