"""The one output-path guard (issue 37 rows 1, 13, 18, 19): every command and API that
writes refuses an output that is, or lies above, an input or the working folder; overwrite
replaces only quantscope's own earlier outputs (files too); concurrent writers never leave
the target absent; what is written has the user's umask."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import bert_folder
from torch import nn

from quantscope import cli
from quantscope.calibration import calibrate, load
from quantscope.exporters.atomic import (
    MARKER,
    atomic_dir,
    atomic_file,
    check_writable_target,
    written_by_quantscope,
)


def _calibration():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return calibrate(model, [torch.randn(4, 16) for _ in range(2)], "w8a8", progress=False)


def _model_folder(path: Path) -> Path:
    """A folder that looks like a user's model (what --model points at)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "bert"}')
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


# --- row 1: never an input, the working folder, or a folder quantscope did not write ---

def test_save_refuses_the_working_folder_and_what_lies_above_it(tmp_path, monkeypatch):
    cal = _calibration()
    work = tmp_path / "project"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", str(work), str(tmp_path)):
        with pytest.raises(ValueError, match="current working folder"):
            cal.save(out)
    assert _tree(work) == {"notes.txt": b"mine"}


def test_overwrite_replaces_only_quantscope_outputs(tmp_path):
    cal = _calibration()
    model = _model_folder(tmp_path / "model")
    before = _tree(model)
    with pytest.raises(ValueError, match="is not a folder quantscope wrote"):
        cal.save(model)  # Calibration.save overwrites by default: never a user's folder
    assert _tree(model) == before
    cal.save(tmp_path / "cal")
    assert written_by_quantscope(tmp_path / "cal")
    cal.save(tmp_path / "cal")  # its own earlier output: replaced
    assert load(tmp_path / "cal").states.keys() == cal.states.keys()
    before = _tree(tmp_path / "cal")
    with pytest.raises(ValueError, match="exists"):  # as SECURITY.md says: refused
        cal.save(tmp_path / "cal", overwrite=False)
    assert _tree(tmp_path / "cal") == before


def test_outputs_written_before_the_marker_are_still_recognised(tmp_path):
    cal = _calibration()
    cal.save(tmp_path / "old")
    os.remove(tmp_path / "old" / MARKER)  # as an earlier quantscope wrote it
    assert written_by_quantscope(tmp_path / "old")
    cal.save(tmp_path / "old")
    (tmp_path / "cmp").mkdir()  # a compare run's folder
    (tmp_path / "cmp" / "report.json").write_text(json.dumps({"setup": {}, "runs": {}}))
    assert written_by_quantscope(tmp_path / "cmp")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "quantscope.json").write_text('{"format": "something else"}')
    assert not written_by_quantscope(tmp_path / "other")


def _strip_marks(folder: Path) -> Path:
    """``folder`` as a quantscope from before the marker file wrote it."""
    for mark in folder.rglob(MARKER):
        mark.unlink()
    return folder


def _llama(folder: Path):
    """The model of a Llama folder and its calibration."""
    pytest.importorskip("compressed_tensors")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    cal = calibrate(model, [{"input_ids": torch.randint(0, 10, (1, 6))}], "w8a8",
                    progress=False)
    return model, cal


def _llama_export(folder: Path, out: Path, **kw):
    from quantscope import export

    model, cal = _llama(folder)
    return export(cal, model, out, **kw)


def _old_outputs(tmp_path: Path, cal) -> dict:
    """One output of each kind quantscope wrote before the marker, by its own writers."""
    import types

    from tiny_models import llama_folder

    from quantscope.cli.calibrate import save_run
    from quantscope.cli.compare import _write_report
    from quantscope.cli.running import Phases

    cal.save(tmp_path / "calibration")
    save_run(str(tmp_path / "run"), cal, cal.report({}), Phases(quiet=True))
    run = {**cal.report({}).to_dict(), "recipe": "w8a8", "observer": "minmax"}
    report = {"setup": {"model": str(tmp_path / "m")}, "runs": {"w8a8/minmax": run},
              "histograms": {f"{k[0]}/{k[1]}": v for k, v in cal.histograms.items()}}
    args = types.SimpleNamespace(out=str(tmp_path / "compare"), no_plots=False,
                                 plot_layer=None, model=None)
    _write_report(args, report, ["a"], [["1"]], "title", 1.0, 1.0)
    llama = llama_folder(tmp_path / "llama")
    _llama_export(llama, tmp_path / "export", max_shard_size="10KB")  # sharded
    return {k: _strip_marks(tmp_path / k) for k in ("calibration", "run", "compare", "export")}


def test_old_outputs_of_every_kind_are_still_replaced(tmp_path):
    cal = _calibration()
    old = _old_outputs(tmp_path, cal)
    assert {p.name for p in (tmp_path / "compare").iterdir()} >= {"hist.png", "sqnr.png"}
    assert len(list((tmp_path / "export").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    # the export then copied every top-level file of the model folder but weights (probe:
    # a Hugging Face model's README.md and sentence-transformers' configs)
    for name in ("README.md", "modules.json", "sentence_bert_config.json"):
        (tmp_path / "export" / name).write_text("{}")
    from quantscope.cli.calibrate import save_run
    from quantscope.cli.running import Phases

    # each replaced by its own kind of output only (a calibration never deletes an export)
    rewrite = {"calibration": cal.save,
               "run": lambda f: save_run(str(f), cal, cal.report({}), Phases(quiet=True)),
               "export": lambda f: _llama_export(tmp_path / "llama", f, overwrite=True)}
    for kind, folder in old.items():
        assert written_by_quantscope(folder), kind
        if kind != "calibration":
            with pytest.raises(ValueError, match="not a calibration"):
                cal.save(folder)
        if kind in rewrite:
            rewrite[kind](folder)  # replaced: with the marker now
            assert written_by_quantscope(folder)
    assert load(old["calibration"]).states.keys() == cal.states.keys()


def test_an_old_outputs_metadata_beside_other_files_is_no_mark(tmp_path, capsys):
    """Probe (legacy_mark_delete.py): a model folder with a calibration saved inside it at
    qparams/ counted as quantscope's run (its qparams/quantscope.json), and Calibration.save
    or export --overwrite deleted the weights, the tokenizer and the notes. An older output is
    recognised only when it holds nothing but what that kind of output consists of."""
    from tiny_models import llama_folder

    cal = _calibration()
    model = llama_folder(tmp_path / "my-llama")
    (model / "NOTES.md").write_text("my notes")
    cal.save(model / "qparams")  # the calibration kept beside its model
    cal.save(tmp_path / "run" / "qparams")
    kinds = _old_outputs(tmp_path / "old", cal)
    for kind, folder in kinds.items():  # an older output with a file of the user's beside it
        if kind == "export":  # it copied any top-level file but weights: a folder, a weight
            (folder / "notes").mkdir()
            (folder / "notes" / "NOTES.md").write_text("my notes")
            (folder / "pytorch_model.bin").write_bytes(b"weights")
        else:
            (folder / "NOTES.md").write_text("my notes")
    for folder in [model, *kinds.values()]:
        before = _tree(folder)
        assert not written_by_quantscope(folder), folder
        with pytest.raises(ValueError, match=f"output '{folder}' exists and is not a folder "
                                             f"quantscope wrote"):
            cal.save(folder)
        assert cli.main(["export", str(tmp_path / "run"), "--model",
                         str(tmp_path / "old" / "llama"), "--out", str(folder),
                         "--overwrite"]) == 2
        assert f"'{folder}' exists and is not a folder quantscope wrote" in \
            capsys.readouterr().err
        assert _tree(folder) == before


def test_an_output_that_is_or_contains_an_input_is_refused(tmp_path):
    model = _model_folder(tmp_path / "models" / "m")
    for out in (model, model.parent, tmp_path):
        with pytest.raises(ValueError, match="input"):
            check_writable_target(out, overwrite=True, inputs=[model])
        with pytest.raises(ValueError, match="input"), atomic_dir(out, overwrite=True,
                                                                  inputs=[model]):
            pass
    link = tmp_path / "link"
    link.symlink_to(model)  # the same folder under another name
    with pytest.raises(ValueError, match="input"):
        check_writable_target(link, overwrite=True, inputs=[model])
    check_writable_target(model / "quantized", inputs=[model])  # inside an input: fine


def test_cli_calibrate_out_never_replaces_the_model_or_the_working_folder(tmp_path, capsys,
                                                                            monkeypatch):
    model = _model_folder(tmp_path / "m")
    before = _tree(tmp_path)
    monkeypatch.chdir(model)
    for out in (".", str(model), str(tmp_path)):
        assert cli.main(["calibrate", "--model", str(model), "--out", out]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and ("input" in err or "working folder" in err), err
    assert _tree(tmp_path) == before


def test_cli_export_never_replaces_the_source_model(tmp_path, capsys):
    model = _model_folder(tmp_path / "m")
    cal = _calibration()
    cal.info["model"] = str(model)
    cal.save(tmp_path / "run" / "qparams")
    before = _tree(tmp_path)
    for out in (model, tmp_path / "run", tmp_path / "run" / "qparams"):
        assert cli.main(["export", str(tmp_path / "run"), "--model", str(model), "--out",
                         str(out), "--overwrite"]) == 2
        assert "input" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_export_run_refuses_its_inputs_before_loading(tmp_path):
    from quantscope.cli.export import export_run

    model = _model_folder(tmp_path / "m")
    cal = _calibration()
    cal.info["model"] = str(model)
    cal.save(tmp_path / "run" / "qparams")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="input"):
        export_run(tmp_path / "run", model, overwrite=True)  # the recorded model
    with pytest.raises(ValueError, match="input"):  # the calibration it reads
        export_run(tmp_path / "run", tmp_path / "run" / "qparams", overwrite=True)
    with pytest.raises(ValueError, match="input"):
        export_run(tmp_path / "run", tmp_path / "run", overwrite=True)
    assert _tree(tmp_path) == before


def test_overwrite_never_replaces_a_file_quantscope_did_not_export(tmp_path):
    """Probe: an ONNX export with overwrite=True replaced the model's own model.safetensors
    (the guard let any file not named .onnx be replaced, as a report). An exported file is
    replaced only when it is quantscope's ONNX file; reports and plots still are replaced."""
    model = _model_folder(tmp_path / "m")
    before = _tree(model)
    for name in ("model.safetensors", "config.json"):
        with pytest.raises(ValueError, match="is not an ONNX file quantscope exported"):
            check_writable_target(model / name, overwrite=True, kind="file", inputs=[model])
        with pytest.raises(ValueError, match="is not an ONNX file quantscope exported"), \
                atomic_file(model / name, kind="file"):
            pass
    assert _tree(model) == before
    report = tmp_path / "report.txt"
    report.write_text("an earlier report")
    with atomic_file(report) as t:  # kind="report": replaced as open(path, "w") would
        Path(t).write_text("new")
    assert report.read_text() == "new"


def test_onnx_export_with_overwrite_leaves_the_model_weights(tmp_path):
    pytest.importorskip("onnx")
    import transformers
    from tiny_models import llama_folder

    from quantscope import export

    folder = llama_folder(tmp_path / "llama")
    before = _tree(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = {"input_ids": torch.randint(0, 10, (1, 6))}
    cal = calibrate(model, [batch], "w8a8", progress=False)
    for name in ("model.safetensors", "tokenizer.json"):
        with pytest.raises(ValueError, match=r"model\.safetensors|tokenizer\.json"):
            export(cal, model, folder / name, format="onnx", overwrite=True,
                   example_inputs=batch)
    assert _tree(folder) == before
    transformers.AutoModelForCausalLM.from_pretrained(folder)  # still loads


# --- rows 13 and 19: an ONNX file output is replaced by --overwrite; modes follow the umask ---

@pytest.fixture
def run_of_tiny_bert(tmp_path):
    from quantscope.demo import models

    d = bert_folder(tmp_path / "tiny-bert", max_position_embeddings=64)
    model, tok = models.load_model(d)
    enc = tok(["a first calibration sentence", "and another one"], return_tensors="pt",
              padding=True)
    cal = calibrate(model, [dict(enc)], "w8a8", progress=False)
    cal.info.update(model=str(d), task="embedding")
    cal.save(tmp_path / "run" / "qparams")
    return tmp_path / "run"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.extended  # four ONNX exports; the overwrite rules run above in make test
def test_cli_export_onnx_overwrite_replaces_the_file(run_of_tiny_bert, tmp_path, capsys,
                                                     umask_022):
    pytest.importorskip("onnx")
    out = tmp_path / "m.onnx"
    args = ["export", str(run_of_tiny_bert), "--format", "onnx", "--out", str(out)]
    assert cli.main(args) == 0
    assert written_by_quantscope(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert cli.main(args) == 2  # exists: refused without --overwrite
    assert "pass overwrite=True (--overwrite)" in capsys.readouterr().err
    first = out.read_bytes()
    out.write_bytes(first)  # (a new inode: replaced, not edited in place, below)
    inode = out.stat().st_ino
    assert cli.main([*args, "--overwrite"]) == 0
    assert out.stat().st_ino != inode and written_by_quantscope(out)
    other = tmp_path / "other.onnx"
    other.write_bytes(b"not ours")
    assert cli.main(["export", str(run_of_tiny_bert), "--format", "onnx", "--out", str(other),
                     "--overwrite"]) == 2
    assert "not an ONNX file quantscope exported" in capsys.readouterr().err
    assert other.read_bytes() == b"not ours"


def test_cli_export_external_data_flag(run_of_tiny_bert, tmp_path, capsys):
    """``--external-data`` writes the weights beside the model (the default only past 2 GiB);
    the flag with another format does nothing, so it is refused before anything loads."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from quantscope.exporters.onnx import session

    ct = tmp_path / "ct"
    assert cli.main(["export", str(run_of_tiny_bert), "--out", str(ct),
                     "--no-external-data"]) == 2
    assert ("--no-external-data applies to --format onnx only, not compressed-tensors"
            in capsys.readouterr().err)
    assert not ct.exists()
    out = tmp_path / "m.onnx"
    assert cli.main(["export", str(run_of_tiny_bert), "--format", "onnx", "--out", str(out),
                     "--external-data"]) == 0
    data = [p.name for p in tmp_path.iterdir() if p.name.endswith(".data")]
    assert len(data) == 1 and re.fullmatch(r"m\.onnx\.[0-9a-f]{16}\.data", data[0]), data
    graph = onnx.load(str(out), load_external_data=False).graph
    external = [t.name for t in graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external, "no initializer was written to the data file"
    session(out)  # ONNX Runtime opens the pair


def test_written_folders_and_files_follow_the_umask(run_of_tiny_bert, tmp_path, umask_022):
    pytest.importorskip("compressed_tensors")
    from quantscope.cli.export import export_run

    out = export_run(run_of_tiny_bert, tmp_path / "ct")
    entries = [Path(out), *Path(out).rglob("*")]
    assert any(p.name == "model.safetensors" for p in entries)
    for p in entries:
        want = 0o755 if p.is_dir() else 0o644
        assert stat.S_IMODE(p.stat().st_mode) == want, p
    os.umask(0o077)  # a private umask gives private modes: the user's choice, not tempfile's
    _calibration().save(tmp_path / "private")
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "private" / "quantscope.json").stat().st_mode) == 0o600
    with atomic_file(tmp_path / "report.json") as t:
        Path(t).write_text("{}")
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == 0o600


def test_export_copies_only_the_model_folders_tokenizer_files(tmp_path, umask_022):
    """Probe (export_info_model.py): the compressed-tensors export copied every file of the
    folder the calibration's quantscope.json named (any folder), followed links, and made a
    0600 key 0644. It copies the model folder's tokenizer files, generation config and chat
    template only, from a folder with a config.json, never through a link, with their modes."""
    from tiny_models import llama_folder

    from quantscope import export

    folder = llama_folder(tmp_path / "llama")
    private = tmp_path / "private"
    private.mkdir()
    for where in (private, folder):
        (where / "id_rsa").write_text("-----BEGIN PRIVATE KEY-----")
        os.chmod(where / "id_rsa", 0o600)
    (folder / "NOTES.md").write_text("my notes")
    (folder / "special_tokens_map.json").symlink_to(private / "id_rsa")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    os.chmod(folder / "tokenizer_config.json", 0o600)  # the user's: it stays theirs
    model, cal = _llama(folder)
    out = Path(export(cal, model, tmp_path / "ct"))
    names = set(os.listdir(out))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert not names & {"id_rsa", "NOTES.md", "special_tokens_map.json"}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert stat.S_IMODE((out / name).stat().st_mode) == \
            stat.S_IMODE((folder / name).stat().st_mode), name
    assert stat.S_IMODE((out / "tokenizer_config.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o644  # written: the umask's
    # the calibration's record names a folder: one without a config.json gives nothing, a
    # model folder its tokenizer files only; the live model's folder comes first
    for record in (private, folder):
        cal.info["model"] = str(record)
        model.config._name_or_path = str(tmp_path / "elsewhere")
        out = Path(export(cal, model, tmp_path / f"from-{record.name}"))
        assert "id_rsa" not in os.listdir(out)
        assert json.loads((out / "config.json").read_text())["quantscope"]["model"] == (
            str(folder) if record == folder else None)
    with pytest.raises(ValueError, match=f"model_path '{private}' is not a model folder"):
        export(cal, model, tmp_path / "ct2", model_path=str(private))


def test_export_copies_a_hugging_face_snapshots_linked_tokenizer(tmp_path):
    """A Hugging Face cache snapshot holds links into its repository's blobs/: those are the
    folder's own files (copied, by content); a link out of the repository is not."""
    from tiny_models import llama_folder

    from quantscope import export

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = llama_folder(repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    (tmp_path / "id_rsa").write_text("-----BEGIN PRIVATE KEY-----")
    for i, name in enumerate(("tokenizer.json", "tokenizer_config.json")):
        blob = repo / "blobs" / f"blob{i}"
        os.replace(snapshot / name, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (snapshot / "special_tokens_map.json").symlink_to(tmp_path / "id_rsa")
    model, cal = _llama(snapshot)
    out = Path(export(cal, model, tmp_path / "ct"))
    for i, name in enumerate(("tokenizer.json", "tokenizer_config.json")):
        assert not (out / name).is_symlink()
        assert (out / name).read_bytes() == (repo / "blobs" / f"blob{i}").read_bytes()
    assert "special_tokens_map.json" not in os.listdir(out)


@pytest.mark.parametrize("repo", ["models--org--tiny", "runs"])
def test_export_takes_no_link_out_of_a_folder_that_only_looks_like_a_snapshot(tmp_path, repo):
    """Only a cache's ``models--*/blobs/`` are a snapshot's own: a link from ``snapshots/m1``
    to its repository's other folders, or from a folder that merely sits in a folder named
    ``snapshots``, is a link out of the folder (not copied)."""
    from tiny_models import llama_folder

    from quantscope import export

    snapshot = llama_folder(tmp_path / repo / "snapshots" / "m1")
    for name, where in (("tokenizer.json", "private"), ("tokenizer_config.json", "blobs")):
        target = tmp_path / repo / where / name
        target.parent.mkdir(exist_ok=True)
        os.replace(snapshot / name, target)
        (snapshot / name).symlink_to(target)
    model, cal = _llama(snapshot)
    out = Path(export(cal, model, tmp_path / "ct"))
    assert "tokenizer.json" not in os.listdir(out)  # <repo>/private: never the folder's own
    assert ("tokenizer_config.json" in os.listdir(out)) == repo.startswith("models--")


# --- row 18: writers racing on one folder ---

_WRITER = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from quantscope.calibration import calibrate
    torch.manual_seed(int(sys.argv[2]))
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    cal = calibrate(m, [torch.randn(4, 16)], "w8a8", progress=False)
    print("ready", flush=True)
    sys.stdin.readline()  # all writers start together
    ok = clear = 0
    for _ in range(int(sys.argv[3])):
        try:
            cal.save(sys.argv[1])
            ok += 1
        except (ValueError, RuntimeError) as e:  # the documented refusals
            assert "output" in str(e), e
            clear += 1
    print("done", ok, clear, flush=True)
""")


def _can_exchange(folder: Path) -> bool:
    from quantscope.exporters import atomic

    (folder / "a").mkdir()
    (folder / "b").mkdir()
    try:
        return atomic._renameat2(str(folder / "a"), str(folder / "b"), atomic._RENAME_EXCHANGE)
    finally:
        shutil.rmtree(folder / "a")
        shutil.rmtree(folder / "b")


@pytest.mark.extended  # concurrent processes
def test_concurrent_saves_keep_the_target_whole(tmp_path):
    if not _can_exchange(tmp_path):
        pytest.skip("no atomic exchange of two names here: writers take turns on a lock, and "
                    "the target is absent for a moment between them")
    target = tmp_path / "cal"
    _calibration().save(target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(target), str(i), "30"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    polls = absent = 0
    while any(p.poll() is None for p in procs):  # progress ends the loop, not a clock
        polls += 1
        if not (target / "quantscope.json").is_file():
            absent += 1
    results = [(p.returncode, p.stdout.read(), p.stderr.read()) for p in procs]
    for rc, out, err in results:
        assert rc == 0, err
    saved = sum(int(out.split()[1]) for _, out, _ in results)
    assert saved + sum(int(out.split()[2]) for _, out, _ in results) == 4 * 30
    assert saved > 0 and polls > 0
    assert absent == 0, f"the target was absent in {absent} of {polls} polls"
    load(target)  # whole: one writer's calibration
    assert sorted(n for n in os.listdir(tmp_path)) == ["cal"]  # no temporary left


def test_a_new_target_created_meanwhile_is_a_clear_error_without_overwrite(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="exists and is not empty"), atomic_dir(target) as t:
        Path(t, "a").write_text("mine")
        _calibration().save(target)  # another writer wins the name first
    assert json.loads((target / "quantscope.json").read_text())["format"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "onnx"])
def test_export_names_a_wrong_calibration_or_path(tmp_path, fmt):
    """Found by probing: a calibration of another type gave "'NoneType' object has no
    attribute 'states'", a path of another type pathlib's bare TypeError."""
    import quantscope

    cal = _calibration()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    for calibration, path, what in [(None, tmp_path / "a", "calibration must be a Calibration"),
                                    (model, tmp_path / "b", "got Sequential"),
                                    (cal, None, "path must be a str or os.PathLike")]:
        with pytest.raises(TypeError, match=what):
            quantscope.export(calibration, model, path, format=fmt)
    assert not any(tmp_path.iterdir())


def test_every_path_argument_names_its_call_when_it_is_no_path():
    """Found by probing: None / an int gave pathlib's bare "expected str, bytes or
    os.PathLike object", naming neither the call nor the argument."""
    import quantscope
    from quantscope import exporters
    from quantscope.calibration import Calibration, save

    cal = _calibration()
    for who, call in [("save", lambda p: save(cal, p)), ("load", load),
                      ("from_compressed_tensors", Calibration.from_compressed_tensors),
                      ("check", exporters.check),
                      ("export compressed-tensors", lambda p: quantscope.export(cal, None, p))]:
        for bad in (None, 5):
            with pytest.raises(TypeError, match=f"^{who}: path must be a str or os.PathLike, "
                                                f"got {type(bad).__name__}$"):
                call(bad)
