"""Probe s37, the synthetic format table: a size it cannot take is an argparse error naming
``--rows`` / ``--cols`` and what they may be (not a traceback), and ``format_table`` (which
``quantscope formats`` calls) says the same; the table runs on one thread whichever front
end asks, and gives the caller's thread count back; ``quantscope formats --help`` does not
promise observers the table does not use."""

import pytest
import torch

from quantscope import cli
from quantscope.demo import formats as demo


@pytest.mark.parametrize("args, said", [
    (["--rows", "0"], "argument --rows: must be a positive integer, got 0"),
    (["--rows", "-3"], "argument --rows: must be a positive integer, got -3"),
    (["--cols", "0"], "argument --cols: must be a positive multiple of 128"),
    (["--cols", "100"], "argument --cols: must be a positive multiple of 128"),
])
def test_demo_sizes_it_cannot_take_are_usage_errors(capsys, args, said):
    with pytest.raises(SystemExit) as e:
        demo.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err, err


@pytest.mark.parametrize("rows, cols, said", [
    (0, 128, "rows must be a positive integer, got 0"),
    (4, 100, "cols must be a positive multiple of 128 (the group sizes 32, 128 must divide it)"),
])
def test_format_table_names_the_size(rows, cols, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        demo.format_table(rows=rows, cols=cols)


@pytest.fixture
def two_threads(monkeypatch):
    """One scheme (fast), whose pricing records torch's thread count; the caller runs on 2."""
    seen = []
    scheme_error = demo.scheme_error

    def recording(x, spec):
        seen.append(torch.get_num_threads())
        return scheme_error(x, spec)

    monkeypatch.setattr(demo, "SCHEMES", demo.SCHEMES[:1])
    monkeypatch.setattr(demo, "scheme_error", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield seen
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("run", [lambda: demo.main(["--rows", "8", "--cols", "128"]),
                                 lambda: cli.main(["formats"])], ids=["demo", "cli"])
def test_table_runs_on_one_thread_and_gives_the_count_back(two_threads, capsys, run):
    assert run() == 0
    assert "int8 per-channel" in capsys.readouterr().out
    assert two_threads == [1, 1, 1]  # three tensors, each on one thread
    assert torch.get_num_threads() == 2


def test_formats_help_promises_no_observers(capsys):
    assert cli.main(["formats", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "observers" not in out and "min-max" in out, out
