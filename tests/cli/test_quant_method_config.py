"""What ``--model`` reads as a quantized checkpoint: a ``quantization_config`` that is not null.

transformers (``get_hf_quantizer`` in quantizers/auto.py) takes ``config.quantization_config``;
null is no quantization (the float weights load, checked with transformers 5.17 and 5.25). A
dict without ``quant_method`` (``{}`` too) (and without ``load_in_4bit`` / ``load_in_8bit``: bitsandbytes)
makes ``AutoHfQuantizer.supports_quant_method`` raise "has no `quant_method` attribute", and a
value that is not a JSON object fails on its ``.get``; so ``--model`` refuses those in its own
words, naming quant_method ``'?'``. A ``quant_method`` of ``""`` is a quantization_config all
the same: refused as the guide's command-line page says (a quantization_config in config.json).
A mutation round found no test failing where these cases were read otherwise.
"""

import json
import re

import pytest

from quantscope._plainchecks import quant_method
from quantscope.cli.checks import UsageError, check_model_arg


def _folder(tmp_path, qc):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    return str(d)


def test_a_null_quantization_config_is_a_float_model(tmp_path):
    assert quant_method({"quantization_config": None}) is None
    check_model_arg(_folder(tmp_path, None))  # no error


@pytest.mark.parametrize("qc, method", [
    ({}, "?"),  # empty: transformers raises "has no `quant_method` attribute" (5.17, 5.25)
    ({"load_in_4bit": True}, "?"),  # bitsandbytes: no quant_method key
    ({"bits": 4, "group_size": 128}, "?"),  # no quant_method at all
    ("gptq", "?"),  # not a JSON object
    (["fp8"], "?"),  # not a JSON object
    ({"quant_method": ""}, ""),  # names an empty method
], ids=["empty", "bnb", "no-method", "string", "list", "empty-method"])
def test_a_quantization_config_without_a_usable_method_is_still_refused(tmp_path, qc, method):
    assert quant_method({"quantization_config": qc}) == method
    with pytest.raises(UsageError, match=r"is a quantized checkpoint .*quant_method "
                                         + re.escape(f"{method!r})")):
        check_model_arg(_folder(tmp_path, qc))
