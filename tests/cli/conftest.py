"""Fixtures of the command-line tests."""

import pytest


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama checkpoint folder (random weights, the Lee corpus tokenizer), per module."""
    pytest.importorskip("transformers")
    from tiny_models import llama_folder

    return str(llama_folder(tmp_path_factory.mktemp("tiny-llama"),
                            architectures=["LlamaForCausalLM"]))
