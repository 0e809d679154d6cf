"""The text the command line prints, character by character: the "next:" commands' shell
words (:func:`quantscope.cli.calibrate.shell_word`), warning lines
(:func:`quantscope.cli._warning_lines`), a strict stream that must print any path
(:func:`quantscope.cli._printable_streams`), and a compat class's name in any case refused as
one (:func:`quantscope.cli.checks.check_observer_name`), and an argparse error with a line
break as one line. Pins mutants SW02, SW04, CI04, CI05, CI09 and CK04 of mutation round s55,
and CI01 of its second round (mut2)."""

import io
import os
import shutil
import subprocess
import sys
import warnings

import pytest
from cli_helpers import run_cli

from quantscope import cli
from quantscope.cli.calibrate import shell_word


@pytest.mark.parametrize("raw, word", [
    (b"runs/\x80", "$'runs/\\x80'"),  # the first byte that is not UTF-8 (cp1252's euro sign)
    (b"runs/\x9f", "$'runs/\\x9f'"), (b"runs/\xff", "$'runs/\\xff'"),  # the last
    (b"r/a\x7fb\xff", "$'r/a\\x7fb\\xff'"),  # DEL is not printable: escaped, not left raw
    (b"r/\x01 \x1f~\xe9", "$'r/\\x01 \\x1f~\\xe9'")])  # a space and '~' are printable
def test_a_name_that_is_not_text_is_one_escaped_word(raw, word):
    """Each byte outside printable ASCII as ``\\xNN`` inside ``$'...'``: a raw DEL is invisible
    on a terminal and lost when copied; a name whose only non-UTF-8 byte is 0x80 was
    shlex-quoted, shown (and pasted) as U+FFFD, another path."""
    assert shell_word(os.fsdecode(raw)) == word


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_every_non_utf8_byte_pastes_back_as_itself():
    """bash reads the word back as the path's bytes, whichever byte 0x80-0xff it holds."""
    raws = [b"r/" + bytes([b]) + b"\x7f'\\" for b in range(0x80, 0x100)]
    words = [shell_word(os.fsdecode(raw)) for raw in raws]
    assert all(w.startswith("$'") and "\x7f" not in w for w in words), words
    script = "".join(f"printf '%s\\0' {w}\n" for w in words)
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == raws


@pytest.mark.parametrize("category, line", [
    (UserWarning, "warning: keep it short\n"),
    (RuntimeWarning, "warning: RuntimeWarning: keep it short\n"),
    (DeprecationWarning, "warning: DeprecationWarning: keep it short\n"),
    (FutureWarning, "warning: FutureWarning: keep it short\n")])
def test_a_warning_line_names_a_category_other_than_userwarning(category, line):
    """A library's deprecation or an overflow (RuntimeWarning) is told apart from quantscope's
    own advice (a UserWarning) by its category's name."""
    with cli._warning_lines():
        assert warnings.formatwarning("keep it short", category, "f.py", 1) == line


def test_a_multi_line_warning_is_one_warning_line():
    """A wrapped library message is one line starting ``warning:``, its whitespace runs one
    space each; a Warning instance (as ``warnings.warn`` passes) reads as its text."""
    text = "first line\n    second\tline  \n"
    with cli._warning_lines():
        assert warnings.formatwarning(text, UserWarning, "f.py", 1) == \
            "warning: first line second line\n"
        assert warnings.formatwarning(RuntimeWarning(text), RuntimeWarning, "f.py", 1) == \
            "warning: RuntimeWarning: first line second line\n"


def _strict(encoding: str) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict", newline="\n")


@pytest.mark.parametrize("encoding, printed", [
    ("ascii", b"runs/caf\\xe9/\xff \\u20ac\n"), ("cp1252", b"runs/caf\xe9/\xff \x80\n"),
    ("utf-8", b"runs/caf\xc3\xa9/\xff \xe2\x82\xac\n")])
def test_a_strict_stream_prints_any_path(monkeypatch, encoding, printed):
    """While a command runs, a strict stdout / stderr whose encoding lacks a character of a
    path (``café`` on an ASCII or cp1252 console) backslash-escapes it, and a non-UTF-8 byte
    of a name prints as that byte, instead of failing the command (exit 2) as it prints its
    summary; the streams are strict again after."""
    out, err = _strict(encoding), _strict(encoding)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    path = "runs/caf\u00e9/" + os.fsdecode(b"\xff") + " \u20ac"
    with cli._printable_streams():
        print(path)
        print(path, file=sys.stderr)
    out.flush()
    err.flush()
    assert out.buffer.getvalue() == printed and err.buffer.getvalue() == printed
    assert out.errors == "strict" and err.errors == "strict"
    with pytest.raises(UnicodeEncodeError):
        print(path, file=out)


@pytest.mark.parametrize("name", ["TORCH.AO:MinMaxObserver", "torch.ao:minmaxobserver",
                                  "Quark:PerTensorMinMaxObserver"])
def test_a_compat_class_in_another_case_is_refused_as_one(tmp_path, capsys, name):
    """Observer names are read in any case, so a compat class's name in another case is
    refused as a compat class (a recipe runs quantscope's native observers), not as an
    unknown name with a "did you mean"."""
    for argv in (["calibrate", "--observer", name],
                 ["compare", "--observers", f"minmax,{name}", "--no-plots"]):
        rc, _, err = run_cli(capsys, *argv, "--model", str(tmp_path / "none"), "--out",
                             str(tmp_path / "run"))
        assert rc == 2 and f"{name!r} is a compat class" in err, err
        assert "unknown observer" not in err and "did you mean" not in err, err


def test_a_recipe_files_compat_class_in_another_case_is_refused_as_one(tmp_path):
    from quantscope.cli.checks import UsageError
    from quantscope.cli.recipes import read_recipe_file

    path = tmp_path / "r.yaml"
    path.write_text("rules:\n  - targets: [Linear]\n    weight:\n      spec: {format: int8}\n"
                    "      observer: TORCH.AO:MinMaxObserver\n")
    # named as the registry spells it (a Role reads observer names so)
    with pytest.raises(UsageError, match=r"rules\[0\]\.weight\) 'torch.ao:MinMaxObserver' is "
                                         r"a compat class"):
        read_recipe_file(str(path))


@pytest.mark.parametrize("argv, said", [
    (["formats", "first\nsecond"], "unrecognized arguments: first second (quantscope formats"),
    (["calibrate", "--bo\n  gus", "x"], "unrecognized arguments: --bo gus x (quantscope calibrate")])
def test_an_argparse_error_with_a_line_break_is_one_line(capsys, argv, said):
    """An argparse error is one line on stderr even where a word the user gave holds a line
    break (an unrecognized argument): its lines joined by one space each, so no second line
    reads as a message of its own."""
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"quantscope {argv[0]}: error: {said}"), err
