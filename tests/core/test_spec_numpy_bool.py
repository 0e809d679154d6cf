"""``QuantSpec(symmetric=...)`` takes a numpy bool as the Python one, as the format flags
(``IntFormat(signed=np.True_)``) and every ``check_bool`` option do, and stores the Python bool
(so ``to_dict`` stays JSON and the spec equals the Python-bool one). It used to refuse it."""

import numpy as np
import pytest

from quantscope import QuantSpec
from quantscope.formats import IntFormat


@pytest.mark.parametrize("flag", [np.True_, np.False_])
def test_quantspec_symmetric_takes_a_numpy_bool_as_the_format_flags_do(flag):
    assert IntFormat(8, signed=flag).signed is bool(flag)
    spec = QuantSpec("int8", symmetric=flag)
    assert spec.symmetric is bool(flag) and spec == QuantSpec("int8", symmetric=bool(flag))
