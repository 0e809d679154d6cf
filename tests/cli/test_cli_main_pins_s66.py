"""Pins of the command line's entry point (``quantscope.cli.main``) that mutation round s66
found unpinned: the one error line of an exception (its class named unless it is a usage,
missing-file or value error; an empty message read as the class; the command's name not said
twice) and of argparse (blank lines dropped); the early checks of every positive count and of
``--sample-budget-mb``; the ``torchrun`` path (the error line names the rank, and only a group
``main`` joined is destroyed); what ``main`` leaves of the caller's process (each library
notice it drops, a command's own changes to the environment, the warnings filters,
``warnings.formatwarning`` and the streams); ``--task``'s two values; and ``formats`` printing
its table on stdout, exit code 0."""

import io
import logging
import os
import sys
import warnings

import pytest
from cli_helpers import run_cli

from quantscope import cli


def _command(monkeypatch, run, name="formats"):
    """``name`` runs ``run(args)`` in place of its own command."""
    monkeypatch.setitem(cli.COMMANDS, name, (cli.COMMANDS[name][0], run))


def _raising(error):
    def run(args):
        raise error
    return run


@pytest.mark.parametrize("error, line", [
    (RuntimeError("boom"), "RuntimeError: boom"),
    (OSError("disk full"), "OSError: disk full"),
    (KeyError("layer"), "KeyError: 'layer'"),
    (FileNotFoundError("no file x.json"), "no file x.json"),
    (ValueError("bad value"), "bad value")])
def test_an_errors_class_is_named_unless_a_value_or_missing_file_error(monkeypatch, capsys,
                                                                       error, line):
    """A usage, missing-file or value error is its message alone; any other exception (an
    OSError other than a broken pipe too: exit code 2, not 1) is named by its class."""
    _command(monkeypatch, _raising(error))
    rc, out, err = run_cli(capsys, "formats")
    assert (rc, out, err) == (2, "", f"quantscope formats: error: {line}\n")


@pytest.mark.parametrize("error", [ValueError(), RuntimeError(), OSError()])
def test_an_error_without_a_message_is_its_class_named_once(monkeypatch, capsys, error):
    """Not ``RuntimeError: RuntimeError``: the class is the whole message."""
    _command(monkeypatch, _raising(error))
    line = f"quantscope formats: error: {type(error).__name__}\n"
    assert run_cli(capsys, "formats") == (2, "", line)


def test_a_message_naming_its_command_names_it_once(monkeypatch, capsys):
    """``quantscope formats: error: bad`` for a message ``formats: bad``, not ``formats``
    twice; the command's name elsewhere in the message stays."""
    _command(monkeypatch, _raising(ValueError("formats: bad formats: here")))
    rc, _, err = run_cli(capsys, "formats")
    assert (rc, err) == (2, "quantscope formats: error: bad formats: here\n")


def test_an_argparse_error_drops_blank_lines(capsys):
    """The lines of an argparse error are joined by one space each, a blank line adding
    none."""
    rc, out, err = run_cli(capsys, "formats", "first\n\n  \nsecond")
    assert (rc, out) == (2, "")
    assert err == ("quantscope formats: error: unrecognized arguments: first second "
                   "(quantscope formats --help lists the options)\n")


@pytest.mark.parametrize("flag", ["--calib-docs", "--max-length", "--batch-size",
                                  "--eval-max-length", "--sample-tokens", "--group-size"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_every_count_must_be_positive_before_the_command_runs(monkeypatch, capsys, flag,
                                                              value):
    ran = []
    _command(monkeypatch, ran.append, "calibrate")
    rc, out, err = run_cli(capsys, "calibrate", flag, value)
    assert (rc, out, ran) == (2, "", [])
    assert err == f"quantscope calibrate: error: {flag} must be a positive integer, got {value}\n"


@pytest.mark.parametrize("budget", ["inf", "nan", "0", "-1"])
def test_the_sample_budget_must_be_a_finite_positive_number(monkeypatch, capsys, budget):
    ran = []
    _command(monkeypatch, ran.append, "calibrate")
    rc, out, err = run_cli(capsys, "calibrate", "--sample-budget-mb", budget)
    assert (rc, out, ran) == (2, "", [])
    assert err == ("quantscope calibrate: error: --sample-budget-mb must be a positive number "
                   f"of MB, got {float(budget)}\n")


def test_a_finite_positive_sample_budget_runs_the_command(monkeypatch, capsys):
    ran = []
    _command(monkeypatch, lambda args: ran.append(args.sample_budget_mb) or 0, "calibrate")
    assert run_cli(capsys, "calibrate", "--sample-budget-mb", "0.5")[0] == 0
    assert ran == [0.5]


@pytest.fixture
def torchrun(monkeypatch):
    """A ``torchrun`` environment (WORLD_SIZE 2) whose process group is faked: joining it
    makes this process rank 1 of 2; the groups destroyed are recorded."""
    dist = pytest.importorskip("torch.distributed")
    from quantscope import distributed as qd

    state = {"initialized": False, "joined": 0, "destroyed": 0}

    def join():
        state["joined"] += 1
        return True

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(dist, "destroy_process_group",
                        lambda *a: state.__setitem__("destroyed", state["destroyed"] + 1))
    monkeypatch.setattr(qd, "init_from_env", join)
    monkeypatch.setattr(qd, "rank", lambda *a: 1)
    monkeypatch.setattr(qd, "world_size", lambda *a: 2)
    return state


@pytest.mark.parametrize("command", ["calibrate", "compare"])
def test_under_torchrun_the_error_line_names_the_rank(torchrun, monkeypatch, capsys, command):
    """calibrate and compare join the group (data-parallel calibration), see their rank and
    world, name the rank in an error line, and leave the group they joined."""
    seen = []

    def run(args):
        seen.append((args.rank, args.world))
        raise ValueError("no such layer")

    _command(monkeypatch, run, command)
    rc, _, err = run_cli(capsys, command)
    assert (rc, err) == (2, f"quantscope {command}: error (rank 1): no such layer\n")
    assert seen == [(1, 2)] and torchrun["joined"] == 1 and torchrun["destroyed"] == 1


def test_under_torchrun_a_callers_process_group_is_left_to_the_caller(torchrun, monkeypatch,
                                                                     capsys):
    torchrun["initialized"] = True  # the caller's own group, made before main
    _command(monkeypatch, lambda args: 0, "calibrate")
    assert run_cli(capsys, "calibrate")[0] == 0
    assert torchrun["joined"] == 1 and torchrun["destroyed"] == 0


def test_under_torchrun_other_commands_join_no_group(torchrun, monkeypatch, capsys):
    seen = []
    _command(monkeypatch, lambda args: seen.append((args.rank, args.world)) or 0)
    assert run_cli(capsys, "formats")[0] == 0
    assert seen == [(0, 1)] and torchrun["joined"] == 0 and torchrun["destroyed"] == 0


@pytest.mark.parametrize("logger, message", [
    ("torchao", "Failed to load the CUDA extension"),
    ("torch.utils._pytree", "<enum 'Kind'> is an Enum subclass and is now natively supported"),
    ("torch.onnx._internal.exporter._registration",
     "torchvision is not installed. Skipping torchvision::nms")])
def test_each_library_notice_is_dropped_while_a_command_runs(monkeypatch, caplog, logger,
                                                             message):
    """The three notices of ``_DropMessages``, each on its logger, are dropped while a
    command runs; that logger's other records are not."""
    def run(args):
        logging.getLogger(logger).warning(message)
        logging.getLogger(logger).warning("a record of its own")
        return 0

    _command(monkeypatch, run)
    with caplog.at_level(logging.WARNING, logger=logger):
        assert cli.main(["formats"]) == 0
    assert [r.getMessage() for r in caplog.records if r.name == logger] == ["a record of its own"]


@pytest.fixture
def no_advisory(monkeypatch):
    """The variable ``main`` sets, unset (the caller's value, if any, back after)."""
    name = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)
    return name


def test_a_variable_the_command_removed_stays_removed(no_advisory, monkeypatch, capsys):
    _command(monkeypatch, lambda args: os.environ.pop(no_advisory) and 0)
    assert run_cli(capsys, "formats") == (0, "", "")
    assert no_advisory not in os.environ


def test_a_variable_the_command_set_keeps_the_commands_value(no_advisory, monkeypatch):
    """Only what ``main`` added is taken out: a value the command set is the command's."""
    def run(args):
        os.environ[no_advisory] = "0"
        return 0

    _command(monkeypatch, run)
    assert cli.main(["formats"]) == 0
    assert os.environ[no_advisory] == "0"


def test_a_command_that_resets_the_warnings_filters_returns_its_code(monkeypatch, capsys):
    """The filter ``main`` added, gone by the time it ends (``warnings.resetwarnings``), is
    not removed a second time (a ValueError out of ``main``)."""
    _command(monkeypatch, lambda args: warnings.resetwarnings() or 0)
    with warnings.catch_warnings():
        assert run_cli(capsys, "formats") == (0, "", "")


def test_a_warning_subclass_of_userwarning_is_named(monkeypatch):
    """Only UserWarning itself is quantscope's plain advice: a subclass is another
    category, named."""
    class LayerWarning(UserWarning):
        pass

    with cli._warning_lines():
        assert warnings.formatwarning("x  y", LayerWarning, "f.py", 1) == \
            "warning: LayerWarning: x y\n"


def test_a_commands_own_formatwarning_is_left_as_it_set_it(monkeypatch):
    def own(*args, **kwargs):
        return "own\n"

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)

    def run(args):
        warnings.formatwarning = own
        return 0

    _command(monkeypatch, run)
    assert cli.main(["formats"]) == 0
    assert warnings.formatwarning is own


def test_a_stream_that_is_not_strict_keeps_its_error_handler(monkeypatch):
    """Only a strict stream is changed while a command runs: a caller's ``replace`` stream
    is not made strict after."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="replace")
    monkeypatch.setattr(sys, "stdout", out)
    _command(monkeypatch, lambda args: print("caf\u00e9") or 0)
    assert cli.main(["formats"]) == 0
    out.flush()
    assert out.errors == "replace" and out.buffer.getvalue() == b"caf?\n"


def test_a_strict_stream_that_cannot_be_reconfigured_is_left_alone(monkeypatch):
    class Plain:
        errors = "strict"

        def __init__(self):
            self.text = []

        def write(self, text):
            self.text.append(text)

        def flush(self):
            pass

    out = Plain()
    monkeypatch.setattr(sys, "stdout", out)
    _command(monkeypatch, lambda args: print("done") or 0)
    assert cli.main(["formats"]) == 0
    assert "".join(out.text) == "done\n"


@pytest.mark.parametrize("command", ["calibrate", "compare"])
@pytest.mark.parametrize("task", ["causal-lm", "embedding"])
def test_task_takes_causal_lm_and_embedding(command, task):
    """The docs: ``--task causal-lm|embedding`` overrides the folder's config."""
    assert cli.build_parser().parse_args([command, "--task", task]).task == task


def test_formats_prints_its_table_on_stdout(monkeypatch, capsys):
    from quantscope.demo import formats

    monkeypatch.setattr(formats, "format_table", lambda: "the table")
    assert run_cli(capsys, "formats") == (0, "the table\n", "")
