"""Observer-state pin found by mutation (s37): an empty percentile state on the meta device
loads into a meta observer."""

import pytest
import torch

from quantscope import QuantSpec, get_observer

SPEC = QuantSpec("int8")


@pytest.mark.parametrize("ema", [0.3, None])
def test_empty_percentile_state_on_meta_loads_with_assign(ema):
    """A percentile observer's state (nothing observed yet) moved to meta loads into a meta
    observer with assign=True: the EMA check skips meta buffers instead of reading them."""
    kw = {"averaging_constant": ema} if ema else {}
    src = get_observer("percentile", SPEC, bins=256, **kw)
    state = {k: v.to("meta") if isinstance(v, torch.Tensor) and k != "_extra_state" else v
             for k, v in src.state_dict().items()}
    dst = get_observer("percentile", SPEC, bins=256, **kw).to("meta")
    dst.load_state_dict(state, assign=True)
    assert all(t.is_meta for t in dst.buffers())
