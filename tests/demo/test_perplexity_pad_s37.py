"""The demo's perplexity of a document does not depend on the batch it is in, whatever side
the tokenizer pads on: left padding shifted a document's positions by its batch's padding
(18.2289 against 18.2396 one document at a time on a tiny Llama)."""

import pytest
import torch


def test_perplexity_of_a_left_padding_tokenizer_is_its_documents_own(tmp_path):
    pytest.importorskip("transformers")
    import tiny_models

    from quantscope.demo import models

    tiny_models.llama_folder(tmp_path / "m")
    model, tok = models.load_model(tmp_path / "m")
    g = torch.Generator().manual_seed(1)
    words = tiny_models.WORDS
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (int(n),), generator=g))
            for n in torch.randint(2, 40, (12,), generator=g)]
    alone = models.perplexity(model, tok, docs, batch_size=1)  # no padding at all
    tok.padding_side = "left"
    batched = models.perplexity(model, tok, docs, batch_size=8)
    assert batched == pytest.approx(alone, rel=1e-6)
    assert tok.padding_side == "left"  # the caller's tokenizer is left as it was
