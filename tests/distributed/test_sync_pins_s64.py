"""Pins of the cross-process sync (quantscope.comm, observers.sync, stats.histogram_sync,
calibration.run.gather, calibration.run.dist_pass) that no spawned test held: the reduction
identities, the header's shape encoding, the stats counters, the error exchange naming the
first failing rank, the histogram re-bin onto the union grid, the weight balance and the
sample and failure gathers. From a mutation round (s64): every test fails on a small defect
the existing tests let through. No process is spawned: the ranks are threads of this process
whose ``torch.distributed`` calls meet at a barrier (``_ranks``), or one process calls the
pure functions directly.
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import quantscope
from quantscope import comm
from quantscope.calibration.run import dist_pass, gather
from quantscope.layout import Channel
from quantscope.observers import record
from quantscope.observers import sync as qsync
from quantscope.spec import QuantSpec
from quantscope.stats import histogram as H
from quantscope.stats.histogram_sync import HistogramSync


class _World:
    """``world`` ranks as threads: the ``torch.distributed`` calls quantscope makes, each
    rank's value exchanged at a barrier (a rank that raises breaks it: no thread waits)."""

    def __init__(self, world):
        self.world, self.local = world, threading.local()
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots = [None] * world
        self.exchanges = [0] * world  # per rank: the collectives it took part in

    def rank(self, group=None):
        return self.local.rank

    def exchange(self, value):
        self.exchanges[self.local.rank] += 1
        self.slots[self.local.rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def all_reduce(self, t, op=dist.ReduceOp.SUM, group=None):
        got = self.exchange(t.clone())
        out = got[0]
        for g in got[1:]:
            out = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum,
                   dist.ReduceOp.MIN: torch.minimum}[op](out, g)
        t.copy_(out)

    def all_gather(self, out, t, group=None):
        for o, g in zip(out, self.exchange(t.clone())):
            o.copy_(g)

    def all_gather_object(self, out, obj, group=None):
        out[:] = self.exchange(obj)

    def run(self, fn):
        """``[fn(rank) for each rank]``, run together; a rank's exception is its result (the
        others, left waiting for it a second later, get ``BrokenBarrierError``)."""
        res, failed = [None] * self.world, []

        def main(r):
            self.local.rank = r
            try:
                res[r] = fn(r)
            except Exception as e:  # noqa: BLE001 -- the test compares the ranks' errors
                res[r] = e
                failed.append(time.monotonic())

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            threads[0].join(0.01)
            if failed and time.monotonic() - failed[0] > 1:
                self.barrier.abort()
        return res


@pytest.fixture
def ranks(monkeypatch):
    """``ranks(world)``: a :class:`_World` installed as ``torch.distributed``'s group."""
    def make(world):
        w = _World(world)
        for name, value in {"is_initialized": lambda: True,
                            "get_world_size": lambda group=None: world,
                            "get_rank": w.rank, "get_backend": lambda group=None: "gloo",
                            "all_reduce": w.all_reduce, "all_gather": w.all_gather,
                            "all_gather_object": w.all_gather_object}.items():
            monkeypatch.setattr(dist, name, value)
        return w
    return make


def _ok(results):
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


# ------------------------------------------------------------------------------ comm
def test_a_group_of_one_process_is_not_distributed(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective in a group of one process")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_reduce", no_collective)
    assert comm.is_distributed() is False
    assert comm.all_sum(5) == 5


def test_shard_of_an_iterator_is_lazy_from_the_rank(ranks):
    w = ranks(3)

    def shards(r):
        return comm.shard(iter(range(10))), comm.shard(range(10))

    for r, (lazy, seq) in enumerate(_ok(w.run(shards))):
        assert not isinstance(lazy, list)
        assert list(lazy) == list(range(r, 10, 3))
        assert seq == list(range(r, 10, 3)) and isinstance(seq, list)


def test_init_from_env_joins_only_past_one_process_with_gloo_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert comm.init_from_env() is False and calls == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert comm.init_from_env() is True and calls == ["gloo"]


def test_a_groups_writer_is_the_global_rank_of_its_rank_0(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: 2 + r)
    group = object()
    assert comm.main_global_rank(group) == 2
    assert comm.main_global_rank(None) == 0


def test_a_calibration_made_here_is_written_here_and_others_log_at_info(monkeypatch, caplog):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert comm.is_writer(None) and comm.is_writer(1) and not comm.is_writer(0)
    with caplog.at_level(logging.DEBUG, logger="quantscope"):
        assert comm.writes_here(0, "save", "out.pt") is False
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "global rank 1 writes nothing to out.pt" in caplog.records[0].getMessage()


def test_all_sum_is_exact_past_32_bits(ranks):
    w = ranks(2)
    assert _ok(w.run(lambda r: comm.all_sum(2 ** 40 + r))) == [2 ** 41 + 1] * 2


def test_local_error_keeps_exceptions_but_lets_an_interrupt_through():
    local = comm.LocalError()
    with local:
        raise ValueError("kept")
    assert str(local.error) == "kept"
    local = comm.LocalError()
    with pytest.raises(KeyboardInterrupt), local:
        raise KeyboardInterrupt
    assert local.error is None


def test_all_or_none_outside_a_group_raises_the_error():
    with pytest.raises(KeyError, match="local"), comm.all_or_none("a step"):
        raise KeyError("local")


def test_every_rank_raises_the_first_failing_ranks_error_naming_all(ranks):
    w = ranks(3)
    errors = [None, KeyError("one"), TypeError("two")]

    def step(r):
        with comm.all_or_none("planning", same_type=True):
            if errors[r] is not None:
                raise errors[r]

    got = w.run(step)
    assert got[1] is errors[1] and got[2] is errors[2]
    assert type(got[0]) is KeyError  # rank 1's type: the first that failed
    assert "one" in str(got[0]) and "(planning failed on rank(s) [1, 2])" in str(got[0])


def test_without_same_type_the_others_raise_a_runtime_error_naming_the_ranks(ranks):
    w = ranks(3)

    def step(r):
        with comm.all_or_none("a step"):
            if r == 2:
                raise ValueError("bad")

    got = w.run(step)
    assert type(got[0]) is RuntimeError and type(got[1]) is RuntimeError
    assert isinstance(got[2], ValueError)
    for other in got[:2]:  # the whole message: the step's name, the ranks, where to look
        assert str(other) == "distributed: a step failed on rank(s) [2]; see their error"


def test_stats_count_each_collective_and_its_payload_bytes(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: None)
    monkeypatch.setattr(dist, "all_gather", lambda out, t, group=None: [o.copy_(t) for o in out])
    comm.reset_stats()
    comm.all_reduce(torch.zeros(3, dtype=torch.float64), dist.ReduceOp.MAX, None)
    assert comm.all_gather(torch.ones(5, dtype=torch.int16), None).shape == (2, 5)
    got = comm.last_stats()
    assert (got.collectives, got.bytes) == (2, 3 * 8 + 5 * 2)
    comm.reset_stats()
    assert (got.collectives, got.bytes) == (2, 34)  # a copy: the reset leaves it
    comm.all_reduce(torch.zeros(1), dist.ReduceOp.MAX, None)
    qsync.sync_observers([])  # outside a group: a no-op that still starts the count afresh
    assert comm.last_stats() == comm.SyncStats(0, 0)


# ---------------------------------------------------------------------- observers.sync
def test_each_reductions_identity():
    """What a rank that saw nothing fills a state with: +inf for MIN, -inf for MAX, 0 for SUM
    (the guide), bool and integer states in their own dtype's terms."""
    assert comm.MIN.identity(torch.bool) is True
    assert comm.MAX.identity(torch.bool) is False
    assert comm.MIN.identity(torch.float16) == float("inf")
    assert comm.MAX.identity(torch.float32) == float("-inf")
    assert comm.MIN.identity(torch.int32) == 2 ** 31 - 1
    assert comm.MAX.identity(torch.int8) == -128
    assert comm.SUM.identity(torch.int64) == 0


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_header_shapes_of_up_to_8_dims_round_trip(shape):
    row = qsync._encode_shape(torch.Size(shape), None, "x")
    assert len(row) == 1 + qsync._MAXD and row[0] == len(shape)
    assert qsync._decode_shape(row) == shape


def test_plan_entries_need_an_op():
    class Odd(quantscope.Observer):
        def sync_plan(self):
            return [("min_vals", "min")]

    with pytest.raises(TypeError, match=r"expected \(buffer, Op\) pairs"):
        qsync._plan(Odd(QuantSpec()))


@pytest.mark.parametrize("mark", [[True, 0], [1, "2"], [1.0, 0]])
def test_a_sync_mark_holds_two_plain_ints(mark):
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    state = {record.RECORD: record.encode({"synced": mark})}
    with pytest.raises(ValueError, match="damaged sync mark"):
        qsync.loaded_mark(obs, state, "")
    good = qsync.loaded_mark(obs, {record.RECORD: record.encode({"synced": [4, 1]})}, "")
    assert {k: int(v) for k, v in good.items()} == {"observed_tokens": 4, "non_finite_count": 1}


def test_a_step_without_data_outside_a_group_is_none():
    obs = quantscope.get_observer("minmax", QuantSpec())
    assert qsync.step_sync(obs, None, None, None) is None
    lo, hi = torch.tensor([1.0]), torch.tensor([2.0])
    assert qsync.step_sync(obs, None, lo, hi) == (None, lo, hi)


def test_empty_step_skips_observers_not_step_synced():
    called = []
    obs = [quantscope.get_observer("minmax", QuantSpec()) for _ in range(2)]
    obs[1].sync_every_step = True
    for o in obs:
        o.step_empty = lambda group=None, o=o: called.append(o)
    qsync.empty_step(obs)
    assert called == [obs[1]]


def test_an_idle_rank_adds_nothing_to_a_step_synced_range(ranks):
    """Rank 1 has no data in the step: the range is rank 0's (all positive: not 0)."""
    w = ranks(2)

    def step(r):
        obs = quantscope.get_observer("minmax", QuantSpec())
        obs.sync_every_step = True
        if r == 0:
            obs(torch.tensor([[2.0, 3.0, 5.0]]))
        else:
            qsync.empty_step([obs])
        return obs.min_vals.clone(), obs.max_vals.clone()

    for lo, hi in _ok(w.run(step)):
        assert lo.tolist() == [2.0] and hi.tolist() == [5.0]


def test_a_gathered_step_of_over_65536_values_a_unit_is_one_process_of_the_concatenation(ranks):
    """The ranks' value counts (70000 and 66000, beyond 16 bits) come back exact: no rank's
    padding is counted as data."""
    w = ranks(2)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) * (1 + r) + r for r, n in enumerate((70000, 66000))]
    ref = quantscope.get_observer("percentile", QuantSpec(), bins=64)
    ref(torch.cat(xs))

    def step(r):
        obs = quantscope.get_observer("percentile", QuantSpec(), bins=64)
        obs.sync_every_step = True
        obs(xs[r])
        return obs.state_dict()

    want = ref.state_dict()
    for got in _ok(w.run(step)):
        assert got.keys() == want.keys()
        for k in want.keys() - {"observed_shape", "observed_tokens"}:  # (this rank's own)
            assert torch.equal(got[k], want[k]), k


def test_the_sync_after_step_synced_histogram_steps_leaves_their_counts(ranks):
    """Step-synced, a histogram is already global: the final sync only adds the counters, in
    3 collectives (the plans' check, the headers, one int64 SUM bucket): no grid exchange."""
    w = ranks(2)
    xs = [torch.tensor([[0.5, -2.0, 3.0]]), torch.tensor([[1.5, 4.0, -0.25]])]
    ref = quantscope.get_observer("percentile", QuantSpec(), bins=64)
    ref(torch.cat(xs, 1))

    def steps(r):
        obs = quantscope.get_observer("percentile", QuantSpec(), bins=64)
        obs.sync_every_step = True
        obs(xs[r])
        before = w.exchanges[r]
        qsync.sync_observers([obs])
        return obs.state_dict(), w.exchanges[r] - before

    want = ref.state_dict()
    for got, collectives in _ok(w.run(steps)):
        assert collectives == 3
        names = [k for k in want if k.startswith("hist_")]
        assert names and all(torch.equal(got[k], want[k]) for k in names)
        assert int(got["observed_tokens"]) == 2  # a token (row) on each rank


def test_the_first_observer_that_differs_is_named(ranks):
    w = ranks(2)

    def sync(r):
        obs = [quantscope.get_observer("static_minmax", QuantSpec(symmetric=s))
               for s in (True, r == 0, r == 0)]
        for o in obs:
            o(torch.ones(2))
        qsync.sync_observers(obs)

    for e in w.run(sync):
        assert isinstance(e, ValueError) and "#1 of 3" in str(e), e


def test_states_of_other_shapes_raise_on_every_rank(ranks):
    w = ranks(2)

    def sync(r):
        obs = quantscope.get_observer("static_minmax", QuantSpec(layout=Channel(-1)))
        obs(torch.ones(2, 4 + 4 * r))
        qsync.sync_observers([obs])

    for e in w.run(sync):
        assert isinstance(e, ValueError) and "of different shapes on different ranks" in str(e)


def test_a_sync_after_one_rank_alone_observed_more_reaches_every_rank(ranks):
    """Synced, then rank 0 alone observes a larger value: the next sync gives both ranks the
    new max and the tokens of one process that saw every batch."""
    w = ranks(2)

    def twice(r):
        obs = quantscope.get_observer("static_minmax", QuantSpec())
        obs(torch.tensor([[1.0, float(r)], [0.5, 0.5]]))  # 2 tokens (rows) a rank
        qsync.sync_observers([obs])
        if r == 0:
            obs(torch.tensor([[7.0, 0.0]]))  # 1 more
        qsync.sync_observers([obs])
        return float(obs.max_vals), int(obs.observed_tokens)

    assert _ok(w.run(twice)) == [(7.0, 5)] * 2


class _Counts(quantscope.Observer):
    """An observer of int64 and bool states: the identity of an idle rank in their dtype."""

    def __init__(self, spec=None):
        super().__init__(spec)
        self.register_buffer("most", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("least", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("hit", torch.zeros(0, dtype=torch.bool))

    def sync_plan(self):
        return {"most": comm.MAX, "least": comm.MIN, "hit": comm.MIN}

    def _observe(self, units, lo, hi):
        self.most = hi.to(torch.int64)
        self.least = lo.to(torch.int64)
        self.hit = hi > 0


def test_an_idle_rank_takes_the_others_integer_and_bool_states(ranks):
    w = ranks(2)

    def sync(r):
        obs = _Counts(QuantSpec())
        if r == 1:
            obs(torch.tensor([-7.0, 9.0]))
        qsync.sync_observers([obs])
        return obs.most, obs.least, obs.hit

    for most, least, hit in _ok(w.run(sync)):
        assert most.dtype == least.dtype == torch.int64 and hit.dtype == torch.bool
        assert (most.tolist(), least.tolist(), hit.tolist()) == ([9], [-7], [True])


# -------------------------------------------------------------- stats.histogram_sync
def _hist(x, bins, absolute):
    st = H.update(H.empty_state(x.shape[0], bins), x, x.amin(1), x.amax(1), absolute)
    return _Holder(st)


class _Holder:
    def __init__(self, st):
        (self.hist_counts, self.hist_exp, self.hist_first, self.hist_lo,
         self.hist_hi) = st

    def state(self):
        return [self.hist_counts, self.hist_exp, self.hist_first, self.hist_lo, self.hist_hi]


@pytest.mark.parametrize("absolute", [False, True])
def test_histograms_synced_equal_one_histogram_of_every_batch(absolute):
    """Two ranks of two observers each (one batch of the grid exchange): each observer's
    synced counts equal, bitwise, one process that saw both ranks' values."""
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(3, 40, generator=g) * s + o for s, o in ((1, 0), (30, 5))]
          for _ in range(2)]  # [rank][observer]: rank 1's ranges are far wider
    it = HistogramSync(absolute=absolute)
    held = [[_hist(x, 64, absolute) for x in per] for per in xs]
    grids = [it.grid_many([(h, it) for h in per])[0] for per in held]
    union = torch.maximum(*grids)
    for per in held:
        it.rebin_many([(h, it) for h in per], [union.clone()])
    for i in range(2):
        ref = _hist(torch.cat([xs[0][i], xs[1][i]], 1), 64, absolute)
        got = held[0][i].state()
        got[0] = held[0][i].hist_counts + held[1][i].hist_counts
        for a, b in zip(got, ref.state()):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(held[0][i].state()[1:],
                                                      held[1][i].state()[1:]))


def test_histograms_batch_only_with_their_own_bins_and_kind():
    a = _Holder(H.empty_state(2, 64))
    b = _Holder(H.empty_state(2, 128))
    key = HistogramSync().batch_key
    assert key(a) == HistogramSync().batch_key(_Holder(H.empty_state(5, 64)))
    assert key(a) != key(b)
    assert key(a) != HistogramSync(absolute=True).batch_key(a)
    assert HistogramSync(absolute=False).absolute is False


def test_an_idle_ranks_histogram_is_empty_of_the_agreed_units_and_bins():
    h = _Holder(H.empty_state(0, 64))
    HistogramSync().empty(h, {"hist_counts": (3, 64)})
    assert h.hist_counts.shape == (3, 64) and h.hist_exp.shape == (3,)
    assert int(h.hist_counts.sum()) == 0


# ---------------------------------------------------------------- calibration gathers
def test_assign_by_size_gives_the_largest_to_the_least_loaded_rank():
    sizes = {"a": 10, "b": 6, "c": 5, "d": 1}
    assert gather.assign_by_size(sizes, world=2) == {"a": 0, "b": 1, "c": 1, "d": 0}


def test_weight_owners_only_of_the_named_layers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert gather.weight_owners(model, ["2"]) == {"2": 0}
    assert gather.weight_owners(model) == {"0": 0, "2": 0}


def test_gathered_samples_keep_the_first_ranks_dtype_cut_to_the_limit(ranks):
    w = ranks(2)
    rows = [torch.arange(6.0).reshape(2, 3).half(), torch.arange(6.0, 15.0).reshape(3, 3)]

    def gathered(r):
        return gather.gather_samples({"k": [rows[r]]}, 4)["k"]

    for got in _ok(w.run(gathered)):
        assert len(got) == 1 and got[0].dtype == torch.float16
        assert torch.equal(got[0], torch.arange(12.0).reshape(4, 3).half())


def test_gathered_float64_rows_are_not_rounded(ranks):
    w = ranks(2)
    x = torch.tensor([[1 + 2 ** -40, 1e300]], dtype=torch.float64)

    def gathered(r):
        return gather.gather_samples({"k": [x] if r else []}, 8)["k"]

    for got in _ok(w.run(gathered)):
        assert got[0].dtype == torch.float64 and torch.equal(got[0], x)


def test_failures_of_one_key_are_the_union_over_the_ranks(ranks):
    w = ranks(2)
    local = [{"w": {"mse": "e0"}}, {"w": {"minmax": "e1"}, "v": {"mse": "e2"}}]
    for got in _ok(w.run(lambda r: gather.gather_failures(local[r]))):
        assert got == {"w": {"mse": "e0", "minmax": "e1"}, "v": {"mse": "e2"}}


def test_options_compare_numbers_as_values():
    """Numbers as floats (64 and 64.0 are one budget; the check compares reprs' CRCs)."""
    assert repr(gather._canonical(64)) == repr(gather._canonical(64.0)) == "64.0"
    assert gather._canonical(True) is True
    assert gather._canonical({"b": 1, "a": 2}) == gather._canonical({"a": 2.0, "b": 1})


def test_weights_of_other_dtypes_with_the_same_bits_differ(ranks):
    w = ranks(2)
    dtypes = [torch.float16, torch.bfloat16]

    def check(r):
        gather.check_same_weights({"0": torch.zeros(4, dtype=dtypes[r])})

    for e in w.run(check):
        assert isinstance(e, ValueError) and "layer '0'" in str(e), e
        assert "float16" in str(e) and "bfloat16" in str(e)


def test_rank_pieces_scale_the_sum_to_the_mean_over_every_piece(ranks):
    w = ranks(2)
    scores = [2.0, 4.0]
    pieces = _ok(w.run(lambda r: gather.RankPieces([2, 1]).piece(lambda: scores[r])))
    assert pieces == [pytest.approx(6.0 * 2 / 3)] * 2


def test_parts_are_gathered_where_the_ranks_batches_differ(ranks):
    w = ranks(2)
    batches = [[torch.zeros(2)], [torch.zeros(2)]]
    same = _ok(w.run(lambda r: gather.gather_parts(lambda: r, batches[r], "x")))
    assert same == [None, None]
    w = ranks(2)
    other = [[torch.zeros(2)], [torch.ones(2)]]
    assert _ok(w.run(lambda r: gather.gather_parts(lambda: r, other[r], "x"))) == [[0, 1]] * 2


def test_batches_crc_tells_shapes_and_dtypes_apart():
    x = torch.zeros(4)
    assert gather._crc([x]) != gather._crc([x.reshape(2, 2)])
    assert gather._crc([x]) != gather._crc([x.view(torch.int32)])


# --------------------------------------------------------------------------- dist_pass
def test_the_fusion_groups_are_the_first_ranks_that_found_any(ranks):
    w = ranks(3)
    found = [[], [["a", "b"]], [["c"]]]
    got = _ok(w.run(lambda r: dist_pass._agreed_groups(found[r], None)))
    assert got == [[["a", "b"]]] * 3


def test_global_counts_sum_batches_and_calls_and_take_the_least_bad_row(ranks):
    w = ranks(2)
    calls = [[4, 1], [2, 5]]
    bad = [SimpleNamespace(first=lambda: (1, 0)), SimpleNamespace(first=lambda: (0, 3))]

    def counts(r):
        acts = {k: SimpleNamespace(calls=c) for k, c in zip("ab", calls[r])}
        n, first = dist_pass._global_counts(3 - r, acts, bad[r], None)
        return n, first, [s.calls for s in acts.values()]

    assert _ok(w.run(counts)) == [(5, (0, 3), [6, 6])] * 2
