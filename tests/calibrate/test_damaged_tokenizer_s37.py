"""A tokenizer file the tokenizers library cannot parse is a ValueError naming the folder and
the caller (it ended an export in "error: Exception: expected , or } at line 1 column 888")."""

import pytest


def test_a_damaged_tokenizer_json_names_the_folder(tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import llama_folder

    from quantscope.calibration.run.hf_loader import load_tokenizer

    folder = llama_folder(tmp_path / "m")
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"load_model: the tokenizer of '{folder}' cannot be "
                                         rf"read \("):
        load_tokenizer(folder, "load_model")
