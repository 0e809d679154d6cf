"""``Outliers(smooth=alpha)`` across ranks that pass their own batches. Each rank measured
SmoothQuant's channel ranges on the first batch of its own list and the ranks reduced them
(MIN / MAX): the ranks agreed, but on the union of their first batches, which no one
process smooths on, and the reduction lost NaN: gloo's MIN / MAX keeps NaN or drops it by
the ranks' order, so a mapping one process skips ("saw NaN or inf") was smoothed where the
NaN batch was not rank 0's; a mapping no rank ran was "saw NaN or inf", not "never ran".
Now the lowest rank that holds a batch measures the ranges on its first one, as
``keep_float`` ranks on it (a batch of 0 rows passed over): every rank smooths as one
process smoothing on that batch; and
``channel_ranges`` reduced over ranks is one process's over all their batches, NaN and
mappings that never ran included.

One spawn of 2 gloo processes; each rank calibrates the one-process references too."""

from __future__ import annotations

import warnings

import pytest
import tiny_models
import torch
from ports import rank_results, spawn_ranks

import quantscope
from quantscope.calibration import Outliers, Runtime
from quantscope.calibration.choice import smooth

pytestmark = pytest.mark.dist  # spawns its own process group

TIMEOUT = 30
#: a token none of the batches holds: its embedding row is NaN in every model here
NAN_TOKEN = 5


def _model():
    model, _ = tiny_models.llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
    return model


def _batches():
    _, (a, b, c) = tiny_models.llama()
    assert not any(bool((x == NAN_TOKEN).any()) for x in (a, b, c))
    nan = a.clone()
    nan[0, 0] = NAN_TOKEN  # its first sequence NaN from there on
    return a, b, c, nan


A, B, C, NAN = _batches()


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, h):
        return self.q_proj(h) * self.k_proj(h).sigmoid() + self.v_proj(h)


class _Layer(torch.nn.Module):
    """A decoder layer's smoothable part that, unlike the llama's, takes a batch of 0 rows."""

    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = torch.nn.LayerNorm(16), _Attn()

    def forward(self, x):
        return x + self.self_attn(self.input_layernorm(x))


def _layer_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(_Layer(), torch.nn.Linear(16, 4)).eval()


#: a batch every module passes through, and one with outlier channels to smooth
ZERO = torch.zeros(0, 16)
WIDE = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 20, 16)

#: case -> (rank 0's list, rank 1's list, one process's list: first the batch smoothed on,
#: then what the ranks' shares observe); static_minmax: the ranks' union is one process's
CASES = {
    "own": ([A, C], [B, C], [A, C]),  # shares: A | C
    "empty": ([], [B, B], [B]),  # rank 1's share: its second batch
    "nan": ([A, C], [NAN, C], [A, C]),  # NaN on rank 1's first batch only: not smoothed on
    # rank 0 holds a batch of 0 rows only: rank 1, holding a value, measures (s50's mutant
    # O06 measured on rank 0's empty batch: nothing smoothed)
    "zero rows": ([ZERO], [WIDE, WIDE], [ZERO, WIDE]),
}
#: the cases calibrating another model than the llama's (which takes no batch of 0 rows)
MODELS = {"zero rows": _layer_model}
#: channel_ranges reduced over the ranks: rank 0's and rank 1's batches, one process's all
RANGES = {"nan1": ([A], [NAN]), "nan0": ([NAN], [A]), "none": ([], [])}


def _calibrate(batches, distributed=False, model=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantscope.calibrate((model or _model)(), batches, "w8a8", observer="static_minmax",
                                    outliers=Outliers(smooth=0.5), progress=False,
                                    runtime=Runtime(distributed=distributed))


def _held(cal) -> dict:
    """The smoothing, its report, and each tensor's scale and zero point."""
    return {"scales": cal.smoothing, "info": cal.info["smooth"],
            "qparams": {(layer, role): (st.qparams.scale, st.qparams.zero_point)
                        for layer, roles in cal.states.items() for role, st in roles.items()
                        if st.qparams is not None}}


def _ranges(batches, distributed=False):
    model = _model()
    return smooth.channel_ranges(model, batches, smooth.find_mappings(model), distributed)


def _scenarios(r, out):
    for case, (*lists, _) in CASES.items():
        out[case] = None
        try:
            out[f"{case}/held"] = _held(_calibrate(lists[r], distributed=True,
                                                   model=MODELS.get(case)))
        except Exception as e:  # noqa: BLE001 -- the parent compares the ranks' errors
            out[case] = f"{type(e).__name__}: {e}"
    for case, lists in RANGES.items():
        out[f"ranges/{case}"] = _ranges(lists[r], distributed=True)


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_scenarios, 2, TIMEOUT)


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
    return a == b


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_smooth_as_one_process(ranks, case):
    *_, alone = CASES[case]
    assert rank_results(ranks, case) == [None, None]
    want = _held(_calibrate(alone, model=MODELS.get(case)))
    assert want["info"]["smoothed"]  # something to compare
    for r, held in enumerate(rank_results(ranks, f"{case}/held")):
        for part in want:
            assert _equal(held[part], want[part]), (r, part)


@pytest.mark.parametrize("case", sorted(RANGES))
def test_reduced_ranges_are_one_process_ranges_of_all_batches(ranks, case):
    want = _ranges([b for part in RANGES[case] for b in part])
    for r, got in enumerate(rank_results(ranks, f"ranges/{case}")):
        assert _equal(got, want), (r, case)


def test_nan_and_never_ran_reasons():
    """What the reduced ranges must keep: one process skips every NaN mapping, and names a
    mapping no batch ran as never run."""
    model = _model()
    why = smooth.smooth(model, [NAN], 0.5)["why"]
    assert why and set(why.values()) == {"saw NaN or inf"}
    assert set(smooth.smooth(_model(), [], 0.5)["why"].values()) == {"never ran"}
