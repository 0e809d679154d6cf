"""The export's warning about MoE experts vLLM's fused MoE refuses ended "transformers and
compressed-tensors load it" (probe s45), but transformers 5.17 and 5.25 fail to load
asymmetric int4 experts ("Asymmetric quant requires zero-point values") and int8 ones; the
warning now says which compressed experts transformers loads, and a dense group's keeps its
line (transformers loads dense layers: tests/export/test_serving_s30.py)."""

import pytest
from test_serving_s30 import _moe_export
from tiny_models import mixtral

from quantscope.exporters.consistency import check

pytest.importorskip("compressed_tensors")


def test_the_experts_warning_says_which_experts_transformers_loads(tmp_path):
    out = str(tmp_path / "out")
    warned = _moe_export(mixtral, "w4a16-asym", out)  # groups of 128: the tiny Mixtral's width
    assert len(warned) == 1 and ".experts.0." in warned[0], warned
    assert "symmetric" in check(out)[0]["vllm"]  # vLLM's WNA16 MoE: symmetric weights only
    assert "transformers and compressed-tensors load it" not in warned[0]
    for words in ("transformers 5.17 / 5.25", "asymmetric int4 and int8 experts fail to load",
                  "symmetric int4 weight-only ones run as apply() does"):
        assert words in warned[0], warned[0]
