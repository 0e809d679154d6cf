"""An observer call's host side off the CPU (issue 35: on a GPU the wall time of a min-max
observer is mostly the host's Python and dispatch): what it skips, with the values and the
state as before; on the CPU, a small batch's one C pass in place of torch's small ops."""

from __future__ import annotations

import math

import pytest
import torch
from op_names import OpNames
from torch import nn

import quantscope
from quantscope import QuantSpec, presets
from quantscope.layout import Channel, Group
from quantscope.observers import base
from quantscope.stats import minmax_layouts

SPECS = {"int8-channel": QuantSpec("int8", Channel(0)), "int4-g32": QuantSpec("int4", Group(32)),
         "nvfp4": presets.NVFP4}


def _x(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 64, generator=g) * (1 + seed)


@pytest.mark.parametrize("sid", list(SPECS))
def test_memoryless_state_takes_the_ops_outputs(sid, monkeypatch):
    """Off the CPU the min / max op returns new tensors, which become the memoryless state
    (as the device path runs it, on the CPU through the op's CPU implementation): the CPU
    observer's qparams bit for bit, the same buffers by name."""
    spec = SPECS[sid]
    cpu = quantscope.get_observer("memoryless_minmax", spec)
    monkeypatch.setattr(base, "layout_minmax", minmax_layouts._op_layout_minmax)
    dev = quantscope.get_observer("memoryless_minmax", spec)
    for seed in (0, 1):
        cpu(_x(seed))
        dev(_x(seed))
        lo, hi = minmax_layouts._op_layout_minmax(_x(seed), spec.layout)
        assert torch.equal(dev.min_vals, lo) and torch.equal(dev.max_vals, hi)
        assert dev.min_vals is dev._buffers["min_vals"]
    assert dev.state_dict().keys() == cpu.state_dict().keys()
    a, b = cpu.calculate_qparams(), dev.calculate_qparams()
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    if a.global_scale is not None:
        assert torch.equal(a.global_scale, b.global_scale)


@pytest.mark.parametrize("name", ["memoryless_minmax", "minmax", "static_minmax"])
def test_minmax_forward_off_the_cpu_sets_no_module_attribute(name, monkeypatch):
    """A min-max observer's call off the CPU (``meta`` stands in for CUDA) writes its state
    and flags without ``nn.Module.__setattr__``, whose checks of parameters, buffers and
    modules cost microseconds a write on every call."""
    obs = quantscope.get_observer(name, SPECS["int8-channel"]).to("meta")
    x = torch.empty(16, 64, device="meta")
    obs(x)  # the first call sizes the state
    calls = []
    setattr_ = nn.Module.__setattr__
    monkeypatch.setattr(nn.Module, "__setattr__",
                        lambda self, k, v: (calls.append(k), setattr_(self, k, v)))
    obs(x)
    assert not calls


@pytest.mark.parametrize("name", ["memoryless_minmax", "minmax"])
@pytest.mark.parametrize("sid", ["int8-channel", "int4-g32"])
def test_minmax_forward_dispatches_no_detach_or_identity_permute(name, sid):
    """Off the CPU a min-max call on a tensor that needs no grad reads it as it is: no
    ``detach`` and no permute that changes nothing (the channel axis first, groups along
    the last), an op each per call; one that needs grad leaves no graph in the state."""
    obs = quantscope.get_observer(name, SPECS[sid]).to("meta")
    x = torch.empty(16, 64, device="meta")
    obs(x)
    with OpNames() as seen:
        obs(x)
    assert not seen.names & {"aten.detach", "aten.permute"}
    cpu = quantscope.get_observer(name, SPECS[sid])
    cpu(_x().requires_grad_())
    assert not cpu.min_vals.requires_grad and cpu.min_vals.grad_fn is None
    want = quantscope.get_observer(name, SPECS[sid])
    want(_x())
    assert torch.equal(cpu.min_vals, want.min_vals) and torch.equal(cpu.max_vals, want.max_vals)


@pytest.mark.parametrize("layout, shape", [(Channel(0), (16, 4, 8)), (Channel(1), (4, 16, 8)),
                                           (Group(8), (4, 32)), (Group(8, 0), (32, 4))])
def test_units_move_an_axis_only_where_it_is_elsewhere(layout, shape):
    """``to_units``: a channel axis already first, or groups along the last axis, take the
    tensor as it is (a permute that changes nothing is an op per observer call), the same
    units as moving the axis."""
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    a = layout.axis % x.dim()
    if isinstance(layout, Channel):
        want = x.movedim(a, 0).reshape(shape[a], -1)
    else:
        want = x.movedim(a, -1).reshape(-1, layout.size)
    with OpNames() as seen:
        got = layout.to_units(x)
    assert torch.equal(got, want)
    moves = a != (0 if isinstance(layout, Channel) else x.dim() - 1)
    assert ("aten.permute" in seen.names) == moves


@pytest.mark.parametrize("name", ["minmax", "memoryless_minmax", "moving_average_minmax"])
def test_a_small_cpu_batch_with_strided_units_takes_the_one_c_pass(name):
    """A small CPU batch whose units are a strided view (a column slice, per-row units) is
    copied contiguous for the C pass that finds the ends and updates the state at once, not
    left to torch's dozen small ops (the same values, nearly twice the host time)."""
    obs = quantscope.get_observer(name, SPECS["int8-channel"])
    x = _x()[:, :32]
    obs(x)
    with OpNames() as seen:
        obs(x)
    assert not seen.names & {"aten.amin", "aten.amax", "aten.aminmax"}, seen.calls
    assert torch.equal(obs.min_vals, x.amin(1)) and torch.equal(obs.max_vals, x.amax(1))


class _OffCpu(torch.Tensor):
    """A CPU tensor that says it is not on the CPU (the device branch, readable here)."""

    @property
    def is_cpu(self):
        return False


@pytest.mark.parametrize("seen, count", [(False, 0), (True, 0), (False, 3)])
def test_ready_check_reads_its_flags_back_once_off_the_cpu(seen, count, monkeypatch):
    """``calculate_qparams``' first check reads the non-finite flag and count back in one
    read off the CPU (each read is a sync with the device), with the same error and
    warning as the CPU's."""
    obs = quantscope.get_observer("memoryless_minmax", SPECS["int8-channel"])
    obs(_x())
    obs.seen_non_finite.fill_(seen)
    obs.non_finite_count.fill_(count)
    for name in ("seen_non_finite", "non_finite_count"):
        obs._buffers[name] = obs._buffers[name].as_subclass(_OffCpu)
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(_OffCpu, name,
                            lambda self, *a, m=method, n=name: reads.append(n) or m(self, *a))
    if seen:
        with pytest.raises(ValueError, match="observed NaN or inf values"):
            obs.check_ready()
    elif count:
        with pytest.warns(UserWarning, match="ignored 3 NaN / inf values"):
            obs.check_ready()
    else:
        obs.check_ready()
    assert len(reads) == 1, reads
