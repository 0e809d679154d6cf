"""``quantscope``: calibrate a model, compare observers, evaluate, export, plot.

Every command runs on a demo model (``minilm``, the default: all-MiniLM-L6-v2; or
``smollm2-135m``: SmolLM2-135M-Instruct) or on any Hugging Face model folder given with
``--model``. The model class and the metric follow the folder's config (``--task``
overrides): a causal LM is scored by its perplexity on the 50 held-out Lee documents, an
encoder by the Lee similarity benchmark (the Pearson correlation of its documents'
embedding cosines with 1,225 human scores) and the mean cosine of quantized to fp32
embeddings. Calibration text: gensim's Lee background corpus, or ``--calib-file``.

Names (recipes, schemes, observers) and the output folder are checked before anything
heavy is imported or loaded; an error is one line on stderr and exit code 2, argparse's
too (``--debug`` prints the traceback first); ``quantscope`` alone prints the help on stderr,
exit code 2; stdout's reader gone (``| head``) exits 1, an interrupt 130. :func:`main` returns
the code, never raising ``SystemExit``. Progress goes to stderr; stdout ends with a short
summary.

The package: :mod:`.names` (the names accepted, known without torch), :mod:`.checks`,
:mod:`.options` (the argument groups the calibrating commands share), :mod:`.running` (model,
data, metric, phases), :mod:`.recipes` (the recipe the flags describe) and one module per
command group: :mod:`.calibrate` (calibrate, evaluate), :mod:`.compare` (compare, plot),
:mod:`.export` (export, check), :mod:`.formats`. Each command module adds its subcommands'
parsers (``add_<command>_parser``) and runs them (``cmd_<command>``); :data:`COMMANDS` lists
them in ``--help`` order.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import logging
import os
import sys
import traceback
import warnings

from .. import __version__
from . import calibrate, compare, export, formats
from .checks import UsageError, check_positive, check_resource_args
from .compare import compare_rows
from .names import KV_CACHE_NAMES, OBSERVER_NAMES, RECIPE_NAMES, SCHEME_NAMES

__all__ = ["KV_CACHE_NAMES", "OBSERVER_NAMES", "RECIPE_NAMES", "SCHEME_NAMES", "build_parser",
           "compare_rows", "main"]

#: every subcommand in ``--help`` order: (adds its parser and arguments, runs it)
COMMANDS = {
    "calibrate": (calibrate.add_calibrate_parser, calibrate.cmd_calibrate),
    "compare": (compare.add_compare_parser, compare.cmd_compare),
    "evaluate": (calibrate.add_evaluate_parser, calibrate.cmd_evaluate),
    "plot": (compare.add_plot_parser, compare.cmd_plot),
    "export": (export.add_export_parser, export.cmd_export),
    "check": (export.add_check_parser, export.cmd_check),
    "formats": (formats.add_formats_parser, formats.cmd_formats),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors in the form of every other: one line on stderr, exit
    code 2 (argparse prints its whole usage first: 18 lines for ``calibrate``), ``--help``
    named for the rest. Its subcommands' parsers are of this class too (``add_subparsers``)."""

    #: the subcommands' parsers by name (the top parser's; set by :func:`build_parser`)
    commands: dict | None = None

    def error(self, message):
        # one line: its line breaks joined, a value's own spaces kept ('a  b' as given)
        one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
        self.exit(2, f"{self.prog}: error: {one_line} ({self.prog} --help lists the options)\n")

    def parse_args(self, args=None, namespace=None):
        # an option no parser took is a subcommand's mistake (argparse's top parser reports
        # it, naming `quantscope --help`, which lists no command's options): its parser says it
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            command = (self.commands or {}).get(getattr(args, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return args


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="quantscope",
        description="Calibrate a model, compare observers, evaluate, export, plot.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  quantscope calibrate --scheme W8A8 --out runs/w8a8\n"
               "  quantscope calibrate --model smollm2-135m --scheme W4A16 --group-size 64 "
               "--out runs/smol\n"
               "  quantscope evaluate runs/smol\n"
               "  quantscope export runs/smol --out smol-w4a16\n"
               "  quantscope compare --recipes w8a8,w4a8 --observers minmax,mse,auto\n"
               "  quantscope plot runs/compare --layer encoder.layer.5.output.dense")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.add_argument("--version", action="version", version=f"quantscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser, _ in COMMANDS.values():
        add_parser(sub)
    parser.commands = sub.choices
    return parser


class _DropMessages(logging.Filter):
    """Drops the import-time notices other libraries log on every run (exactly these)."""

    NOISE = ("Failed to load ",  # torchao: its CUDA-only extensions on a CPU build
             "is an Enum subclass and is now natively supported",  # torch's _pytree, via torchao
             "is not installed. Skipping ")  # torch.onnx: torchvision's ops, for every export

    def filter(self, record):
        msg = record.getMessage()
        return not any(n in msg for n in self.NOISE)


#: set while a command runs (read when a notice is logged), as the caller had them after
_QUIET_ENV = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


@contextlib.contextmanager
def _quiet_third_parties():
    """Other libraries' notices off while a command runs. ``main`` is a function of the
    caller's process: its loggers, warnings filters and environment are as they were after
    (only what this adds is taken out: filters an import adds meanwhile are the library's)."""
    drop = _DropMessages()
    loggers = [logging.getLogger(name) for name in
               ("torchao", "torch.utils._pytree", "torch.onnx._internal.exporter._registration")]
    for logger in loggers:
        logger.addFilter(drop)
    # torch.onnx's exporter pickles pytree specs through a deprecated check, once per export
    message = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    ours = warnings.filters[0]
    if ours in before:  # the caller's own: left where it was
        warnings.filters[:], ours = before, None
    added = {k: v for k, v in _QUIET_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key, value in added.items():
            if os.environ.get(key) == value:
                del os.environ[key]
        if ours is not None and ours in warnings.filters:
            warnings.filters.remove(ours)
        for logger in loggers:
            logger.removeFilter(drop)


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as the command line's own: ``warning: <message>``, one line (not Python's
    ``<frozen runpy>:88: UserWarning: ...``, whose location means nothing to a user of the
    command); a category other than UserWarning is named."""
    kind = "" if category is UserWarning else f"{category.__name__}: "
    return f"warning: {kind}{' '.join(str(message).split())}\n"


@contextlib.contextmanager
def _warning_lines():
    """Warnings shown as :func:`_warning_line` says while a command runs: Python's
    ``warnings.formatwarning``, so that a caller recording them (``catch_warnings(record=True)``,
    ``pytest.warns``) still gets them; the caller's comes back after."""
    before = warnings.formatwarning
    warnings.formatwarning = _warning_line
    try:
        yield
    finally:
        if warnings.formatwarning is _warning_line:  # (else the command's own, left as set)
            warnings.formatwarning = before


#: the error handler of a strict stdout or stderr while a command runs (registered then): a
#: name that is not text (a file name's non-UTF-8 byte, which Python holds as a lone
#: surrogate) is written as its bytes, as under a C locale; another character the encoding
#: lacks, backslash-escaped
_STREAM_ERRORS = "quantscope.cli.names"


def _names_as_bytes(error):
    try:
        return codecs.lookup_error("surrogateescape")(error)
    except UnicodeEncodeError:  # (not a surrogate of a byte)
        return codecs.lookup_error("backslashreplace")(error)


@contextlib.contextmanager
def _printable_streams():
    """A strict stdout (Python's under a UTF-8 locale; stderr is strict only where a caller
    made it so) made to print any path while a command runs (:data:`_STREAM_ERRORS`): else
    a run saved whole under a non-UTF-8 ``--out`` name failed printing its summary, exit
    code 2. The caller's streams get their own mode back."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) != "strict" or not hasattr(stream, "reconfigure"):
            continue
        codecs.register_error(_STREAM_ERRORS, _names_as_bytes)
        with contextlib.suppress(ValueError, OSError):  # (a closed stream: no printing)
            stream.reconfigure(errors=_STREAM_ERRORS)
            changed.append(stream)
    try:
        yield
    finally:
        for stream in changed:
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="strict")


def main(argv=None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit code:
    0, 2 for an error (one line on stderr), 1 where stdout's reader left, 130 on an interrupt;
    never raises ``SystemExit`` (argparse's, ``--help``'s, a command's own)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (2) or --help (0): the code
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    if args.command is None:  # a usage error whose answer is the help: on stderr, exit 2
        parser.print_help(sys.stderr)
        return 2
    with _quiet_third_parties(), _printable_streams(), _warning_lines():
        try:
            return _run(args)
        finally:  # --threads: the caller's process keeps its own count
            if getattr(args, "threads_before", None):
                import torch

                torch.set_num_threads(args.threads_before)


def _run(args) -> int:
    args.rank, args.world = 0, 1
    joined = False
    try:
        check_positive(args, "calib_docs", "max_length", "batch_size", "eval_max_length",
                        "sample_tokens", "group_size")
        check_resource_args(args)
        budget = getattr(args, "sample_budget_mb", None)
        if budget is not None and not (0 < budget < float("inf")):
            raise UsageError(f"--sample-budget-mb must be a positive number of MB, got {budget}")
        # under torchrun (WORLD_SIZE > 1): join the process group; calibration is
        # data-parallel (only then is torch.distributed imported before the checks)
        if args.command in ("calibrate", "compare") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            from .. import distributed as qd

            had_group = dist.is_available() and dist.is_initialized()
            joined = qd.init_from_env() and not had_group
            args.rank, args.world = qd.rank(), qd.world_size()
        return COMMANDS[args.command][1](args)
    except BrokenPipeError:  # `quantscope formats | head`: the reader left; say nothing
        with contextlib.suppress(OSError, ValueError):  # (a stdout with no file: left as is)
            out, null = sys.stdout.fileno(), os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, out)
            finally:
                os.close(null)
        return 1
    except KeyboardInterrupt:
        print(f"quantscope {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # sys.exit inside a command (a library's): main() returns its code
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(f"quantscope {args.command}: error: {' '.join(str(e.code).split())}",
              file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 -- every error: one line, exit 2 (--debug: where)
        if args.debug:
            traceback.print_exc()
        where = f" (rank {args.rank})" if args.world > 1 else ""
        msg = " ".join(str(e).split())  # every line of it, as one
        msg = msg.removeprefix(f"{args.command}: ")  # named once: "quantscope export: error:"
        if len(msg) > 500:
            msg = msg[:500] + " ... (--debug shows all)"
        kind = "" if isinstance(e, (UsageError, FileNotFoundError, ValueError)) else (
            f"{type(e).__name__}: ")
        line = f"{kind}{msg}" if msg else type(e).__name__  # no message: its class, once
        print(f"quantscope {args.command}: error{where}: {line}", file=sys.stderr)
        return 2
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()

