"""A qspec without a dtype is quark_spec's ``ValueError`` ("dtype None is not supported") for
every Quark class: Quark's uniform-scaling classes (``uniform=True``) read the dtype before it
was checked and raised ``AttributeError`` (``None.startswith``). Found by the s65 mutation
round of compat.quark_spec."""

from __future__ import annotations

import pytest

from quantscope.compat import quark
from quantscope.compat.quark_spec import quark_spec


def test_a_qspec_without_a_dtype_is_a_value_error_when_uniform():
    with pytest.raises(ValueError, match="dtype None is not supported"):
        quark_spec({"qscheme": "per_tensor"}, uniform=True)


def test_a_uniform_class_refuses_a_qspec_without_a_dtype_with_a_value_error():
    with pytest.raises(ValueError, match="dtype"):
        quark.PerTensorMinMaxObserver({"qscheme": "per_tensor"})
