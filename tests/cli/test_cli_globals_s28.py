"""Probe s28: ``quantscope.cli.main(argv)`` and ``quantscope.demo.models.load_model`` are
functions of the caller's process: what they change to run quietly (environment variables,
a warnings filter, logging filters, transformers' verbosity and progress bars) is theirs
only while they run, on a normal return, a usage error, an exception or ``SystemExit``; and
a model folder loads with no network and no ``HF_HUB_OFFLINE`` (huggingface_hub reads that
once, at import, so setting it would keep the whole process offline)."""

import importlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import warnings

import pytest

from quantscope import cli

LOGGERS = ("torchao", "torch.utils._pytree", "torch.onnx._internal.exporter._registration")
ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_NO_ADVISORY_WARNINGS")


def _process_state():
    return (dict(os.environ), list(warnings.filters),
            {name: list(logging.getLogger(name).filters) for name in LOGGERS})


@pytest.fixture
def clean(monkeypatch):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    with warnings.catch_warnings():  # the test's own changes to the filters stay in it
        yield


def _command(monkeypatch, run):
    """``formats`` runs ``run(args)`` in place of its own command."""
    add_parser, _ = cli.COMMANDS["formats"]
    monkeypatch.setitem(cli.COMMANDS, "formats", (add_parser, run))


def test_main_leaves_the_process_as_it_found_it(clean, capsys, monkeypatch):
    before = _process_state()
    _command(monkeypatch, lambda args: 0)  # what main adds does not depend on the command
    for _ in range(3):  # the logging filters piled up, one per call
        assert cli.main(["formats"]) == 0
    assert cli.main(["calibrate", "--batch-size", "0"]) == 2  # a usage error
    assert _process_state() == before


def test_main_restores_on_exceptions_and_system_exit(clean, capsys, monkeypatch):
    before = _process_state()

    def boom(args):
        raise RuntimeError("boom")

    _command(monkeypatch, boom)
    assert cli.main(["formats"]) == 2  # one line on stderr
    assert cli.main(["--debug", "formats"]) == 2  # the traceback first, the same exit code
    assert "Traceback" in capsys.readouterr().err
    assert _process_state() == before

    def leave(args):
        raise SystemExit(3)

    _command(monkeypatch, leave)
    assert cli.main(["formats"]) == 3  # its code returned, not raised (review s55)
    assert _process_state() == before


def test_main_is_quiet_while_it_runs(clean, monkeypatch, caplog):
    seen = {}

    def run(args):
        seen["env"] = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
        logging.getLogger("torchao").warning("Failed to load a CUDA-only extension")
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning,
                          stacklevel=1)
        seen["warned"] = len(caught)
        return 0

    _command(monkeypatch, run)
    with caplog.at_level(logging.WARNING, logger="torchao"):
        assert cli.main(["formats"]) == 0
        assert seen == {"env": "1", "warned": 0}
        assert not [r for r in caplog.records if r.name == "torchao"]
        logging.getLogger("torchao").warning("Failed to load a CUDA-only extension")  # after
    assert [r.name for r in caplog.records] == ["torchao"]
    assert "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ


def test_main_keeps_the_callers_own_values(clean, monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "0")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("error", category=DeprecationWarning)  # the caller's first filter
    before = _process_state()
    _command(monkeypatch, lambda args: 0)
    assert cli.main(["formats"]) == 0
    assert _process_state() == before


# ------------------------------------------------------------------ load_model
@pytest.fixture
def hf_logging():
    """transformers' logging, its settings put back after the test."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf

    saved = _settings(hf)
    yield hf
    hf.set_verbosity(saved[0])
    (hf.enable_progress_bar if saved[1] else hf.disable_progress_bar)()
    _hub_bars().clear()
    _hub_bars().update(saved[2])


def _hub_bars() -> dict:
    """huggingface_hub's progress-bar switches (the module's: its package names the class)."""
    return importlib.import_module("huggingface_hub.utils.tqdm").progress_bar_states


def _settings(hf):
    return hf.get_verbosity(), hf.is_progress_bar_enabled(), dict(_hub_bars())


@pytest.mark.parametrize("verbosity,bars", [(logging.INFO, True), (logging.WARNING, False)])
def test_load_model_restores_transformers_settings(llama_dir, hf_logging, monkeypatch,
                                                   verbosity, bars):
    from huggingface_hub.utils import disable_progress_bars

    from quantscope.demo import models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hf_logging.set_verbosity(verbosity)
    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    disable_progress_bars("some.group")  # a group of the caller's (a global switch clears it)
    before, inside, real = _settings(hf_logging), [], models.pretrained

    def spy(*args, **kwargs):
        inside.append((*_settings(hf_logging)[:2], kwargs.get("local_files_only")))
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "pretrained", spy)
    models.load_model(llama_dir)
    assert inside == [(logging.ERROR, False, True)]  # quiet, and local files only, inside
    assert _settings(hf_logging) == before
    assert "HF_HUB_OFFLINE" not in os.environ


def test_load_model_restores_them_when_it_fails(llama_dir, hf_logging, tmp_path):
    from quantscope.demo import models

    shutil.copy(os.path.join(llama_dir, "config.json"), tmp_path)
    hf_logging.set_verbosity(logging.INFO)
    before = _settings(hf_logging)
    with pytest.raises(ValueError, match="no tokenizer files"):
        models.load_model(tmp_path)
    assert _settings(hf_logging) == before


def test_load_model_needs_no_network(llama_dir, monkeypatch):
    from quantscope.demo import models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tried = []

    def refuse(*args, **kwargs):
        tried.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    model, _ = models.load_model(llama_dir)
    assert model.training is False and not tried


def test_load_model_leaves_huggingface_hub_online(llama_dir):
    """huggingface_hub imported by load_model itself (a fresh process) reads the caller's
    environment: not offline, and children inherit no HF_HUB_OFFLINE."""
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    code = ("import os, sys\n"
            "from quantscope.demo import models\n"
            f"models.load_model({llama_dir!r})\n"
            "import huggingface_hub.constants as c\n"
            "from transformers.utils import logging as hf\n"
            "print(os.environ.get('HF_HUB_OFFLINE'), c.is_offline_mode(), hf.get_verbosity(),"
            " hf.is_progress_bar_enabled())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["None", "False", str(logging.WARNING), "True"]
