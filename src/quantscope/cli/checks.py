"""Command-line checks that run before anything heavy is imported or loaded: a mistake is
a :class:`UsageError` (one line on stderr, exit code 2), with the closest names suggested."""

from __future__ import annotations

import difflib
import os
import re
import sys

from .._jsonfile import read_json
from .._plainchecks import demo_model_name, quant_method, spelt_as_scheme
from .names import DEMO_MODELS, OBSERVER_NAMES, RECIPE_NAMES, SCHEME_NAMES


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit code 2."""


def suggest(name: str, names, shown: int | None = None) -> str:
    """The closest of ``names`` as a question, else the names (the first ``shown`` of them).
    Compared in any case (``MSE`` is close to ``mse``; difflib's own ratio is case-sensitive),
    each offered as spelt (``w8a8`` and ``W8A8``, where a list holds both)."""
    names = list(names)
    spelt = {}
    for n in names:
        spelt.setdefault(n.lower(), []).append(n)
    close = difflib.get_close_matches(name.lower(), list(spelt), n=3, cutoff=0.5)
    if close:
        return f"did you mean {' or '.join(repr(n) for c in close for n in spelt[c])}?"
    more = f" and {len(names) - shown} more" if shown is not None and len(names) > shown else ""
    return f"expected one of {', '.join(names[:shown])}{more}"


def closest(name: str, names, what: str) -> UsageError:
    return UsageError(f"unknown {what} {name!r}; {suggest(name, names)}")


def check_name(name: str, names, what: str, fold=str.lower) -> str:
    by = {fold(n): n for n in names}
    if fold(name) not in by:
        raise closest(name, list(names), what)
    return by[fold(name)]


#: the observers a recipe runs: quantscope's native ones and auto (a compat class,
#: ``torch.ao:MinMaxObserver``, is configured by its toolkit's own arguments: no spec)
RECIPE_OBSERVERS = tuple(n for n in OBSERVER_NAMES if ":" not in n)


def check_observer_name(name: str, what: str) -> str:
    """An observer a recipe's role runs (:data:`RECIPE_OBSERVERS`), given in any case (as
    ``--recipe`` and ``--scheme`` are), as the registry spells it; a compat class's name is
    refused as such (calibrate would refuse it only after the model loads, in the Python API's
    words)."""
    if ":" in name and name.lower() in map(str.lower, OBSERVER_NAMES):
        raise UsageError(f"{what} {name!r} is a compat class, configured by its toolkit's own "
                         f"arguments (no spec); a recipe runs quantscope's native observers: "
                         f"{', '.join(RECIPE_OBSERVERS)}")
    return check_name(name, RECIPE_OBSERVERS, what)  # (check_name folds to lower case)


def check_recipe_name(name: str, kind: str | None = None) -> str:
    """A recipe name as its registry spells it: a quantscope preset (``kind="preset"``,
    ``--recipe``: lower case, any case accepted but a scheme's exact spelling), a
    compressed-tensors scheme (``"scheme"``, ``--scheme``: upper case, any case accepted but
    a preset's exact spelling) or, where one flag takes both (``compare
    --recipes``: ``kind=None``), either, told apart by the exact spelling: ``w8a8`` is the
    preset (static inputs), ``W8A8`` the scheme (dynamic per-token inputs). The spelling
    returned says which one :func:`.recipes.build_recipe` builds."""
    # the other kind's exact spelling names that one, not this (W8A8 is no w8a8)
    if kind == "preset" and spelt_as_scheme(name, RECIPE_NAMES) or \
            kind == "scheme" and spelt_as_scheme(name.upper(), RECIPE_NAMES) and name.islower():
        flag, its, other_flag = (("--recipe", "a scheme's", "--scheme") if kind == "preset"
                                 else ("--scheme", "a preset's", "--recipe"))
        raise UsageError(f"{flag} {name!r} is {its} spelling (give it to {other_flag}): "
                         f"presets are lower case, schemes as compressed-tensors spells them, "
                         f"and the two may differ (w8a8: static per-tensor inputs, W8A8: "
                         f"dynamic per-token ones)")
    if kind == "preset":
        return check_name(name, RECIPE_NAMES, "recipe")
    if kind == "scheme":
        return check_name(name, SCHEME_NAMES, "scheme", str.upper)
    return check_name(name, RECIPE_NAMES + SCHEME_NAMES, "recipe or scheme", str)


def check_distinct(flag: str, names) -> None:
    """A comma-separated list that names one thing twice would merge its configurations."""
    twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if twice:
        raise UsageError(f"{flag} names {', '.join(map(repr, twice))} more than once; give "
                         f"each once")


def check_input_file(flag: str, path: str) -> None:
    """A file a command reads, before anything loads: missing, a folder, and not a regular
    file (a device such as /dev/null, a pipe) are three different mistakes."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a folder; expected a file")
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path!r} does not exist")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path!r} is not a regular file")


def calib_documents(path: str) -> list[str]:
    """``--calib-file``'s documents: UTF-8 text, one per non-empty line."""
    from ..demo.data import read_corpus

    try:
        return read_corpus(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"--calib-file: {e}") from None


def check_calib_file(args) -> None:
    """``--calib-file`` read before the model loads (no torch needed): a file that is not
    UTF-8 text, or holds none, fails at once."""
    path = getattr(args, "calib_file", None)
    if path is not None:
        check_input_file("--calib-file", path)
        calib_documents(path)


def check_positive(args, *names) -> None:
    for n in names:
        v = getattr(args, n, None)
        if v is not None and v < 1:
            raise UsageError(f"--{n.replace('_', '-')} must be a positive integer, got {v}")


#: the kinds of device --device takes, with an optional index (``cuda:1``); whether this
#: machine has that device is asked of torch once the names are checked (running.resolve_device)
DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu")


def check_resource_args(args) -> None:
    """``--threads`` and ``--device`` of any command that takes them, before torch is
    imported (torch's own errors name neither flag, and come after the model has loaded)."""
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 0:
        raise UsageError(f"--threads must be 0 (torch's choice) or a positive number of "
                         f"threads, got {threads}")
    device = getattr(args, "device", None)
    if device is not None and device != "auto" and not re.fullmatch(
            rf"({'|'.join(DEVICE_KINDS)})(:\d+)?", device):
        raise UsageError(f"--device must be auto, {', '.join(DEVICE_KINDS)} or one of them "
                         f"with an index (cuda:1), got {device!r}")


def check_model_arg(path) -> None:
    """``--model`` before anything loads: a demo model's name, or the folder that will load
    (:func:`~quantscope._plainchecks.demo_model_name`: a folder named ``minilm`` here is
    that folder, checked as any path, and said to be)."""
    if path is None or demo_model_name(path) is not None:
        return
    if str(path).lower() in DEMO_MODELS:  # (it exists, as a file or folder here)
        print(f"warning: --model {path}: the folder {os.path.join('.', path)} here, not the "
              f"demo model of that name (a path that exists comes first)", file=sys.stderr)
    if not os.path.exists(path):
        raise UsageError(f"--model {path!r} does not exist (a Hugging Face model folder, or one "
                         f"of the demo models {', '.join(DEMO_MODELS)})")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise UsageError(f"--model {path!r} is not a Hugging Face model folder (no config.json)")
    try:  # read here, so a damaged file is named (transformers' errors do not name it)
        data = read_json(config, f"--model {path!r}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not isinstance(data, dict):
        raise UsageError(f"--model {path!r}: {config} holds a {type(data).__name__}, not a "
                         f"JSON object")
    method = quant_method(data)
    if method is not None:  # transformers would load it decompressed, in its storage dtype
        raise UsageError(f"--model {path!r} is a quantized checkpoint ({config} has a "
                         f"quantization_config, quant_method {method!r}): its weights are "
                         f"stored as codes and scales, not float weights; give the float "
                         f"(unquantized) model it was made from")


def check_out(path, inputs=(), what: str | None = None) -> None:
    """``--out`` against the one output-path guard: never an input, the working folder, or a
    folder quantscope did not write (``inputs``: the paths the command reads); ``what``: the
    kind of output the command writes (``"calibrate-run"``), so a folder of another kind (an
    export) is refused now, not at saving, after the model was calibrated and evaluated."""
    from ..exporters.atomic import check_writable_target

    try:
        check_writable_target(path, overwrite=True, inputs=inputs, what=what)
    except (OSError, ValueError) as e:
        raise UsageError(f"--out: {e}") from None


_OBSERVER_FLAGS = ("observer", "weight_observer", "input_observer")


def check_recipe_args(args) -> None:
    """Every name, before anything heavy is imported: torch loads in seconds, a model in more."""
    for name in ("recipe", "scheme", "recipe_file", *_OBSERVER_FLAGS):
        if getattr(args, name) == "":  # (an unset shell variable) not "not given": the default
            raise UsageError(f"--{name.replace('_', '-')}: empty value; give a name, or leave "
                             f"the flag out")
    given = [a for a in ("recipe", "scheme", "recipe_file") if getattr(args, a)]
    if len(given) > 1:
        raise UsageError(f"give one of --recipe, --scheme, --recipe-file (got "
                         f"{', '.join('--' + g.replace('_', '-') for g in given)})")
    if args.recipe:
        args.recipe = check_recipe_name(args.recipe, "preset")
    if args.scheme:
        args.scheme = check_recipe_name(args.scheme, "scheme")
    if args.recipe_file:  # its content is read before the model loads: recipes.read_recipe_file
        check_input_file("--recipe-file", args.recipe_file)
    if not given:
        args.recipe = "w8a8"
    for flag in _OBSERVER_FLAGS:
        if getattr(args, flag):
            setattr(args, flag, check_observer_name(
                getattr(args, flag), f"observer (--{flag.replace('_', '-')})"))
    check_activation_args(args)


def check_activation_args(args) -> None:
    if args.keep_float < 0:
        raise UsageError(f"--keep-float must be 0 or more activations, got {args.keep_float}")
    smooth = getattr(args, "smooth", None)
    if smooth is not None and not 0 <= smooth <= 1:
        raise UsageError(f"--smooth must be an alpha in [0, 1], got {smooth}")
    if smooth is not None and getattr(args, "sequential", None):
        raise UsageError("--smooth measures the activations with a forward of the whole "
                         "model: not with --sequential")
    if args.fallback != "dynamic" and not args.keep_float:
        raise UsageError(f"--fallback {args.fallback} says what --keep-float's activations "
                         f"become: give --keep-float N too")
    if args.keep_float and getattr(args, "sequential", None):
        raise UsageError("--keep-float ranks the activations with a forward of the whole "
                         "model: not with --sequential")


def check_library_args(args) -> None:
    """The values the library's own rules decide, named by their flags before the model
    loads: ``--seed``'s range and the ``--targets`` / ``--ignore`` patterns. These import
    torch (the calibration package): calibrate and compare call this after every check that
    needs nothing heavy (names, --model, --out), so a typo there still fails at once."""
    check_seed(args)
    check_patterns(args)


def check_patterns(args) -> None:
    """``--targets`` / ``--ignore`` as the recipe will read them (a ``re:`` pattern that does
    not compile), named by the flag: the recipe's own error names ``Rule.targets``. A
    ``--targets`` with no pattern (no layer) says what it is for: ``--kv-cache`` alone."""
    from ..calibration.recipe_dict import patterns

    if getattr(args, "targets", None) == [] and not getattr(args, "kv_cache", None):
        raise UsageError("--targets with no pattern quantizes no layer: add --kv-cache to "
                         "calibrate the KV cache alone")
    for flag in ("targets", "ignore"):
        try:
            patterns(f"--{flag}", getattr(args, flag, None))
        except ValueError as e:
            raise UsageError(str(e)) from None


def check_seed(args) -> None:
    """``--seed`` in the range ``Sampling(seed=)`` takes (torch's), before the model loads:
    torch's own overflow comes after it and names no flag. Imports torch: call it after the
    checks that need none (:func:`check_library_args`)."""
    seed = getattr(args, "seed", None)
    if seed is None:
        return
    from ..calibration.options import SEED_RANGE

    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise UsageError(f"--seed must be in [{low}, {high}] (what torch.manual_seed takes), "
                         f"got {seed}")


def run_qparams(run: str) -> str:
    """The qparams folder of a calibrate run folder (or the folder itself)."""
    for cand in (os.path.join(run, "qparams"), run):
        if os.path.isfile(os.path.join(cand, "quantscope.json")):
            return cand
    raise UsageError(f"{run!r} is not a `quantscope calibrate` run (no qparams/quantscope.json "
                     f"in it)")


def run_model_path(command: str, run, given=None, recorded=None):
    """The model folder of a run: ``given`` (--model), else the one the run ``recorded`` (its
    ``info["model"]``); a :class:`UsageError` naming --model where none is recorded or the
    recorded folder has gone (moved or deleted since the run)."""
    from ..demo import models

    if given:
        return models.resolve_model_path(given)
    if not recorded:
        raise UsageError(f"{command}: {run} does not record its model; pass --model")
    try:
        return models.resolve_model_path(recorded)
    except FileNotFoundError as e:
        raise UsageError(f"{command}: {run} records its model as {str(recorded)!r}, which is "
                         f"not there now ({e}); pass --model PATH") from None
