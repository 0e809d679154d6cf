"""docs/benchmarks.md's generator (bench/results_page.py, `make bench-docs`) and the results
files bench/run.py writes for it: a small fixed bench output renders to the expected page."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))  # run.py imports results_page as a sibling, as it runs
    try:
        spec = importlib.util.spec_from_file_location(f"quantscope_bench_{name}",
                                                      BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


page = _load("results_page")

HEADER = {"date": "2026-11-28 09:00 UTC, 1 min 5 s", "command": "python bench/run.py minmax",
          "machine": "AMD EPYC (family 25 model 17), 2 cores, x86_64; ISA avx2 avx512f",
          "load": "0.50 at the start, 1.20 at the end (1-minute load average)",
          "threads": "2", "versions": "python 3.11.7, torch 2.13.0+cpu"}

MINMAX_OUT = """\
{"case": "per-channel", "ms": 3.09}
{"case": "group-128", "ms": 3.5}
### min-max observers: median ms

| case | quantscope | torch.ao |
|---|---|---|
| per-channel | 3.09 | 21.8 |
"""

NEW_OUT = ("2026-11-28T09:07:47.9702 | get_main_device | WARNING - No accelerator available!\n"
           "progress: done\n## a bench's own heading\n\nnew bench, 1 row\n")

NOTES = """\
Hand-written notes, one section per bench (this line is dropped).

## minmax

How: one C pass per unit.

## fusion and MoE

Not rendered: no results file.
"""

OLD_PAGE = """\
<!-- bench-docs:head:begin -->
# quantscope benchmarks

How to read this page.
<!-- bench-docs:head:end -->

## minmax

stale diary text that the generator drops
"""

#: the header list results_page renders for HEADER (the two sections differ in the command)
HEADER_MD = """\
- **date**: 2026-11-28 09:00 UTC, 1 min 5 s
- **command**: python bench/run.py minmax
- **machine**: AMD EPYC (family 25 model 17), 2 cores, x86_64; ISA avx2 avx512f
- **load**: 0.50 at the start, 1.20 at the end (1-minute load average)
- **threads**: 2
- **versions**: python 3.11.7, torch 2.13.0+cpu
"""

EXPECTED = """\
<!-- bench-docs:head:begin -->
# quantscope benchmarks

How to read this page.
<!-- bench-docs:head:end -->

## minmax

<minmax header>
```json
{"case": "per-channel", "ms": 3.09}
{"case": "group-128", "ms": 3.5}
```

### min-max observers: median ms

| case | quantscope | torch.ao |
|---|---|---|
| per-channel | 3.09 | 21.8 |

How: one C pass per unit.

## zz_new

<new header>
progress: done

### a bench's own heading

new bench, 1 row
""".replace("<minmax header>\n", HEADER_MD + "\n").replace(
    "<new header>\n", HEADER_MD.replace("run.py minmax", "run.py zz_new") + "\n")


@pytest.fixture
def tree(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    # written in the reverse of page order: the page orders them, not the file system
    (results / "zz_new.txt").write_text(page.format_result(
        "zz_new", {**HEADER, "command": "python bench/run.py zz_new"}, NEW_OUT))
    (results / "minmax.txt").write_text(page.format_result("minmax", HEADER, MINMAX_OUT))
    (results / "notes.md").write_text(NOTES)
    (tmp_path / "benchmarks.md").write_text(OLD_PAGE)
    return tmp_path


def test_fixed_output_renders_the_expected_page(tree):
    args = ["--results", str(tree / "results"), "--page", str(tree / "benchmarks.md")]
    assert page.main(args) == 0
    assert (tree / "benchmarks.md").read_text() == EXPECTED
    page.main(args)  # the head survives a second pass: the page is a fixed point
    assert (tree / "benchmarks.md").read_text() == EXPECTED


def test_known_sections_come_in_page_order_with_their_headings():
    names = ["cuda", "zz_new", "fusion_moe", "aa_new", "minmax", "gpu"]
    assert page.order(names) == ["minmax", "fusion_moe", "gpu", "cuda", "aa_new", "zz_new"]
    text = page.render_section("fusion_moe", HEADER, "x", "")
    assert text.startswith("## fusion and MoE\n")


def test_result_round_trip_and_malformed_input():
    text = page.format_result("mse", HEADER, "\n\n| a |\n|---|\n| 1 |\n\n")
    assert page.parse_result(text) == ("mse", HEADER, "| a |\n|---|\n| 1 |")
    with pytest.raises(ValueError, match="lacks \\['load'\\]"):
        page.format_result("mse", {k: v for k, v in HEADER.items() if k != "load"}, "x")
    with pytest.raises(ValueError, match="bad.txt: expected '# bench: <name>'"):
        page.parse_result("| a |\n|---|\n", where="bad.txt")
    no_date = text.replace("date: ", "when: ")
    with pytest.raises(ValueError, match="lacks \\['date'\\]"):
        page.parse_result(no_date)


def test_page_without_the_head_markers_or_results_is_refused(tree):
    (tree / "benchmarks.md").write_text("# quantscope benchmarks\n")
    with pytest.raises(SystemExit, match="bench-docs:head:begin"):
        page.main(["--results", str(tree / "results"), "--page", str(tree / "benchmarks.md")])
    with pytest.raises(SystemExit, match="no results in"):
        page.render("head", tree, "")  # tree itself holds no *.txt


def test_results_file_named_for_another_bench_is_refused(tree):
    (tree / "results" / "mse.txt").write_text(page.format_result("minmax", HEADER, "x"))
    with pytest.raises(ValueError, match="names bench 'minmax', expected 'mse'"):
        page.render("head", tree / "results", "")


def test_run_saves_what_the_bench_and_its_children_print(tmp_path, monkeypatch, capfd):
    run = _load("run")
    # a bench whose child process writes to the inherited stdout, as bench_goals' peer does
    (tmp_path / "bench_tiny.py").write_text(textwrap.dedent(f"""\
        import subprocess
        def main():
            print("### tiny\\n\\n| a |\\n|---|\\n| 1 |", flush=True)
            subprocess.run([{sys.executable!r}, "-c", "print('from the child')"], check=True)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(run, "git_rev", lambda: "bbb2222")  # a commit landed during the bench
    common = {"machine": HEADER["machine"], "threads": "2", "rev": "aaa1111",
              "versions": "python 3.11.7, quantscope 0.1.0 (git aaa1111)"}
    run.run_one("tiny", common, tmp_path / "results")
    name, header, body = page.parse_result((tmp_path / "results" / "tiny.txt").read_text())
    assert (name, header["command"]) == ("tiny", "python bench/run.py tiny")
    assert body == "### tiny\n\n| a |\n|---|\n| 1 |\nfrom the child"
    assert "from the child" in capfd.readouterr().out  # still reaches the terminal
    assert "1-minute load average" in header["load"]
    assert header["versions"] == "python 3.11.7, quantscope 0.1.0 (git aaa1111 at the start, " \
                                 "bbb2222 at the end)"


def test_run_rejects_an_unknown_bench_name():
    out = subprocess.run([sys.executable, str(BENCH / "run.py"), "no_such_bench"],
                         capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert "no bench named ['no_such_bench']" in out.stderr


def test_committed_page_is_what_bench_docs_writes():
    """docs/benchmarks.md is the generator's output of the committed results: a hand edit of
    the page alone (not of its results file or notes.md) is undone by the next
    `make bench-docs`, so it fails here."""
    results = BENCH / "results"
    committed = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    regenerated = page.render(page.kept_head(committed, "docs/benchmarks.md"), results,
                              (results / "notes.md").read_text())
    assert regenerated == committed, "edit bench/results/*, then run `make bench-docs`"
