"""calibrate(..., Runtime(distributed=True)) agrees with one process where a rank's shard
alone would not: the gathered ``auto`` sample has one dtype on every rank (a rank without
batches too), a dynamic role's NaN raises the same ValueError on every rank wherever it fell,
and ``info["missing"]``'s call counts are the totals over the ranks.

One spawn of 2 gloo processes runs every scenario (a spawn costs seconds); each rank also
calibrates in one process (``distributed=False``) for the figure to compare with. The
process group's timeout is short, so a rank left waiting fails in seconds, not minutes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ports import error_text, rank_results, spawn_ranks

import quantscope
from quantscope import comm
from quantscope.calibration import Auto, Runtime
from quantscope.calibration.recipe import preset

pytestmark = [pytest.mark.dist, pytest.mark.extended]  # spawns its own process group

TIMEOUT = 20  # seconds a collective waits for a peer; the spawn gets a few times that


def _scales(cal) -> dict:
    return {(layer, role): (st.observer, st.qparams.scale.clone())
            for layer, roles in cal.states.items() for role, st in roles.items()
            if st.qparams is not None}


def _bf16_auto() -> dict:
    """One bf16 batch on 2 ranks: rank 1 has no rows of its own, yet scores on bf16 rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8)).eval().to(torch.bfloat16)
    batches = [torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
               .to(torch.bfloat16)]
    return {f"bf16_auto/{d}": _scales(quantscope.calibrate(
        model, batches, "w8a8", observer="auto", auto=Auto(metric="tensor"), progress=False,
        runtime=Runtime(distributed=d))) for d in (False, True)}


def _ignoring_nan(name: str):
    """Preset ``name`` whose (dynamic) input reads NaN / inf as zero."""
    recipe = preset(name)
    (rule,) = recipe.rules
    return replace(recipe, rules=(replace(rule, input=replace(
        rule.input, options={"non_finite": "ignore"})),))


def _dynamic_nan() -> dict:
    """A NaN in a dynamic role's input, in the batch of rank 0 or of rank 1."""
    out = {}
    for where in (0, 1):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4)).eval()
        batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
                   for i in range(3)]
        batches[where][0, 0] = float("nan")
        for label, recipe in (("error", "w8a8-dynamic"),
                              ("ignore", _ignoring_nan("w8a8-dynamic"))):
            for d in (False, True):
                out[f"nan/{where}/{label}/{d}"] = error_text(
                    quantscope.calibrate, model, batches, recipe, progress=False,
                    runtime=Runtime(distributed=d))
    out["nan/after"] = comm.all_sum(comm.rank() + 1)  # the ranks are still in step
    return out


class _CalledEmpty(torch.nn.Module):
    """``b`` is called every batch, never with a row: a role that saw no tokens."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        self.b(h[:0])
        return h


def _missing_calls() -> dict:
    torch.manual_seed(0)
    model = _CalledEmpty().eval()
    batches = [torch.randn(4, 8) for _ in range(3)]  # rank 0 takes 2, rank 1 takes 1
    out = {}
    for d in (False, True):
        with pytest.warns(UserWarning, match="saw no tokens"):
            cal = quantscope.calibrate(model, batches, "w8a8", observer="static_minmax",
                                       progress=False,
                                       runtime=Runtime(distributed=d, missing="skip"))
        out[f"missing/{d}"] = cal.info["missing"]
        out[f"missing_error/{d}"] = error_text(
            quantscope.calibrate, model, batches, "w8a8", observer="static_minmax",
            progress=False, runtime=Runtime(distributed=d, missing="error"))
    return out


def _scenarios(r, out):
    for scenario in (_bf16_auto, _dynamic_nan, _missing_calls):
        out.update(scenario())


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _same_scales(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][0] == b[k][0] and torch.equal(a[k][1], b[k][1])
                                        for k in a)


def test_auto_on_a_bf16_model_gives_every_rank_the_one_process_qparams(ranks):
    # the batch's rows reach rank 1 through the float32 payload: it scores them as bf16 too
    one = rank_results(ranks, "bf16_auto/False")
    assert _same_scales(one[0], one[1])
    for r, got in enumerate(rank_results(ranks, "bf16_auto/True")):
        assert _same_scales(got, one[r]), (r, got, one[r])


@pytest.mark.parametrize("where", [0, 1])
def test_a_dynamic_roles_nan_raises_the_same_error_on_every_rank(ranks, where):
    one = rank_results(ranks, f"nan/{where}/error/False")
    assert one[0] is not None and one[0].startswith(
        f"ValueError: calibrate: layer '0' input: calibration batch {where} (counting from 0) "
        f"brought NaN or inf values (dynamic role")
    assert rank_results(ranks, f"nan/{where}/error/True") == one


@pytest.mark.parametrize("where", [0, 1])
def test_a_dynamic_roles_ignored_nan_raises_on_no_rank(ranks, where):
    assert rank_results(ranks, f"nan/{where}/ignore/False") == [None, None]
    assert rank_results(ranks, f"nan/{where}/ignore/True") == [None, None]


def test_the_ranks_stay_in_step_after_a_dynamic_roles_nan(ranks):
    assert rank_results(ranks, "nan/after") == [1 + 2] * 2


def test_missing_reports_the_calls_of_every_rank(ranks):
    one = rank_results(ranks, "missing/False")
    assert one[0] == [{"layer": "b", "role": "input", "calls": 3,  # once per batch
                       "fallback": "input not quantized"}]
    assert rank_results(ranks, "missing/True") == one
    err = rank_results(ranks, "missing_error/False")
    assert err[0] is not None and "was called 3 times but saw no tokens" in err[0]
    assert rank_results(ranks, "missing_error/True") == err
