"""docs/benchmarks.md, regenerated from the saved bench outputs (`make bench-docs`).

    python bench/run.py minmax && python bench/results_page.py    # or: make bench-docs

`bench/run.py` saves each bench's output, under a header of the run (date, machine, load,
threads, versions), to ``bench/results/<name>.txt``; this script renders one ``## <section>``
per results file: the header as a list, the output as it printed (markdown tables), then the
hand-written notes of that section from ``bench/results/notes.md`` (analysis that is not a
figure). The page's head, between ``<!-- bench-docs:head:begin -->`` and
``<!-- bench-docs:head:end -->``, is hand-written and kept; everything else is rewritten, so
each case shows its latest run once and history lives in git.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- bench-docs:head:begin -->", "<!-- bench-docs:head:end -->"
SEPARATOR = "---"
#: header keys in the order a results file writes them
HEADER_KEYS = ("date", "command", "machine", "load", "threads", "versions")
#: results name -> section heading, in page order; the docs link `benchmarks.md#<anchor>`, so
#: these headings stay. A name not listed (a new bench) follows them, headed by its name.
SECTIONS = {"minmax": "minmax", "mse": "mse", "imatrix": "imatrix", "histogram": "histogram",
            "quark": "quark", "fakequant": "fakequant", "distributed": "distributed",
            "onnx": "onnx", "fusion_moe": "fusion and MoE", "memory": "memory", "goals": "goals",
            "gpu": "gpu", "sass": "sass", "cuda": "cuda", "auto": "auto"}


def format_result(name: str, header: dict[str, str], body: str) -> str:
    """The text of ``bench/results/<name>.txt``: ``# bench: <name>``, ``key: value`` lines, a
    ``---`` line, then the bench's output as it printed."""
    missing = [k for k in HEADER_KEYS if k not in header]
    if missing:
        raise ValueError(f"format_result: header lacks {missing} (expected keys {HEADER_KEYS})")
    lines = [f"# bench: {name}"] + [f"{k}: {header[k]}" for k in HEADER_KEYS]
    return "\n".join(lines + [SEPARATOR, body.strip("\n"), ""])


def parse_result(text: str, where: str = "results") -> tuple[str, dict[str, str], str]:
    """(name, header, body) of a results file's text; ``where`` names it in errors."""
    head, sep, body = text.partition(f"\n{SEPARATOR}\n")
    lines = head.splitlines()
    if not sep or not lines or not lines[0].startswith("# bench: "):
        raise ValueError(f"{where}: expected '# bench: <name>', 'key: value' lines and a "
                         f"'{SEPARATOR}' line before the output")
    header = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    missing = [k for k in HEADER_KEYS if k not in header]
    if missing:
        raise ValueError(f"{where}: header lacks {missing}")
    return lines[0][len("# bench: "):].strip(), header, body.strip("\n")


def split_notes(text: str) -> dict[str, str]:
    """``## <section>`` -> its hand-written text, from notes.md (text before the first
    heading is the file's own comment and is dropped)."""
    notes: dict[str, str] = {}
    for chunk in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, rest = chunk.partition("\n")
        notes[title.strip()] = rest.strip("\n")
    return notes


#: a log line of a peer's logger (llm-compressor's loguru: "2026-11-28T09:07:47.9702 | fn |
#: WARNING - ..."), printed into the output by a peer's import, not by the bench
PEER_LOG = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+ \| \w+ \| [A-Z]+ - .*\n?", re.MULTILINE)


#: a run of lines that are each one JSON object (a bench's raw rows, e.g. bench_fusion_moe's)
JSON_ROWS = re.compile(r"^(?:\{.*\}\n?)+", re.MULTILINE)


def clean(body: str) -> str:
    """The output as the page shows it: peers' log lines dropped, raw JSON rows in a code block,
    a bench's own ``#`` / ``##`` lines made ``###`` (only the page makes sections), each
    heading after a blank line (a progress line just before it would otherwise swallow it into
    a paragraph)."""
    body = PEER_LOG.sub("", body)
    body = JSON_ROWS.sub(lambda m: f"\n```json\n{m.group(0).rstrip(chr(10))}\n```\n\n", body)
    body = re.sub(r"^#{1,2} ", "### ", body, flags=re.MULTILINE)
    body = re.sub(r"([^\n])\n(#+ )", r"\1\n\n\2", body)
    return re.sub(r"\n{3,}", "\n\n", body)


def render_section(name: str, header: dict[str, str], body: str, notes: str) -> str:
    title = SECTIONS.get(name, name)
    lines = [f"## {title}", ""] + [f"- **{k}**: {header[k]}" for k in HEADER_KEYS]
    out = "\n".join(lines) + "\n\n" + clean(body).strip("\n") + "\n"
    if notes:
        out += "\n" + notes + "\n"
    return out


def order(names: list[str]) -> list[str]:
    """Known sections in page order, then new benches by name."""
    known = [n for n in SECTIONS if n in names]
    return known + sorted(n for n in names if n not in SECTIONS)


def render(head: str, results_dir: Path, notes_text: str) -> str:
    """The whole page: the kept head, then one section per results file."""
    files = {p.stem: p for p in sorted(results_dir.glob("*.txt"))}
    if not files:
        raise SystemExit(f"results_page: no results in {results_dir}: run `make bench` first")
    notes = split_notes(notes_text)
    sections = []
    for stem in order(list(files)):
        name, header, body = parse_result(files[stem].read_text(), where=str(files[stem]))
        if name != stem:
            raise ValueError(f"{files[stem]}: names bench {name!r}, expected {stem!r}")
        sections.append(render_section(name, header, body, notes.get(SECTIONS.get(name, name),
                                                                     "")))
    return f"{BEGIN}\n{head.strip(chr(10))}\n{END}\n\n" + "\n".join(sections)


def kept_head(page: str, where: str) -> str:
    """The hand-written head between the markers of the current page."""
    if BEGIN not in page or END not in page:
        raise SystemExit(f"results_page: {where} has no {BEGIN} ... {END} block")
    return page.split(BEGIN, 1)[1].split(END, 1)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(HERE / "results"),
                   help="folder of <name>.txt results (bench/run.py writes them)")
    p.add_argument("--notes", default=None, help="hand-written notes (default: RESULTS/notes.md)")
    p.add_argument("--page", default=str(HERE.parent / "docs" / "benchmarks.md"),
                   help="the page to rewrite (its head block is kept)")
    p.add_argument("--stdout", action="store_true", help="print the page instead of writing it")
    args = p.parse_args(argv)
    results = Path(args.results)
    notes_path = Path(args.notes) if args.notes else results / "notes.md"
    page = Path(args.page)
    notes = notes_path.read_text() if notes_path.is_file() else ""
    text = render(kept_head(page.read_text(), str(page)), results, notes)
    if args.stdout:
        print(text, end="")
        return 0
    page.write_text(text)
    print(f"results_page: rewrote {page} from {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
