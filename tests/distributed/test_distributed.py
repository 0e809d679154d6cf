"""quantscope.distributed: statistics sync across processes on gloo (CPU, loopback).

Process spawns cost seconds each, so every spawn runs many scenarios: each rank
builds the same global batches from a seed, observes its shard, syncs, and records
its qparams beside the qparams of a single process that saw all the batches
(computed locally on every rank, no communication). The parent asserts.

Exactness asserted: bitwise for min / max states (static, memoryless, EMA with
sync_every_step) and histogram counts; the approximate AVG mode of moving averages
is checked against its definition (mean of the per-rank averages), to 1e-6 relative.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from ports import free_port, start_ranks
from tiny_models import bert_folder

import quantscope
from quantscope import distributed as qd
from quantscope.layout import Channel, Tensor
from quantscope.observers import sync as qsync
from quantscope.spec import QuantSpec

pytestmark = pytest.mark.dist

# A hang is detected by progress, not by a wall-clock budget (a loaded machine is slow, not
# hung): the spawned processes fail only when none of them, nor their children, used any CPU
# for STALL seconds. A collective that waits for a dead peer fails sooner (60 s, below).
STALL = 120


def _batches(n, seed=0, shape=(3, 5, 8)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(shape, generator=g) * (1 + i)
        x[..., i % shape[-1]] += 4.0 * (-1) ** i  # an outlier channel that moves
        out.append(x)
    return out


def _specs():
    return {
        "tensor_sym": QuantSpec(),
        "channel_asym": QuantSpec(layout=Channel(-1), symmetric=False),
    }


def _families():
    """Observer names that exist now, with options; later families are added as they land."""
    fams = {"static_minmax": {}, "memoryless_minmax": {}, "minmax": {"averaging_constant": 0.3}}
    have = set(quantscope.list_observers())
    small = {"bins": 128}  # a small histogram keeps the searches fast; sync is the same
    for name, opts in [("mse", {}), ("memoryless_mse", {}), ("percentile", small),
                       ("entropy", small), ("histogram", small), ("histogram_mse", small),
                       ("mix", small)]:
        if name in have:
            fams[name] = opts
    return fams


def _qp(obs):
    qp = obs.calculate_qparams()
    return {"scale": qp.scale.clone(), "zp": qp.zero_point.clone(),
            "tokens": obs.observed_tokens.clone()}  # the counter is updated in place


def _record(obs):
    try:
        return _qp(obs)
    except ValueError as e:
        return {"error": str(e)}


class _HistObserver(quantscope.Observer):
    """A bare per-unit histogram observer on stats.histogram (checks the counts' sync
    directly, whatever estimator sits on top)."""

    def __init__(self, spec=None, bins=64, absolute=False):
        super().__init__(spec)
        from quantscope.stats import histogram as H

        self.bins, self.absolute = bins, absolute
        for n, v in zip(("hist_counts", "hist_exp", "hist_first", "hist_lo", "hist_hi"),
                        H.empty_state(0, bins)):
            self.register_buffer(n, v)

    def _sync_plan(self):
        return [qd.HistogramSync(absolute=self.absolute)]

    def _observe(self, units, lo, hi):
        from quantscope.stats import histogram as H

        if self.hist_counts.shape[0] != units.shape[0]:
            for n, v in zip(("hist_counts", "hist_exp", "hist_first", "hist_lo", "hist_hi"),
                            H.empty_state(units.shape[0], self.bins)):
                setattr(self, n, v)
        st = H.update(H.HistState(self.hist_counts, self.hist_exp, self.hist_first,
                                  self.hist_lo, self.hist_hi), units, lo, hi, self.absolute)
        (self.hist_counts, self.hist_exp, self.hist_first, self.hist_lo,
         self.hist_hi) = st

    def state(self):
        return {n: getattr(self, n).clone() for n in
                ("hist_counts", "hist_exp", "hist_first", "hist_lo", "hist_hi")}


# --------------------------------------------------------------------------- worker
class _LlamaShaped(torch.nn.Module):
    """One decoder layer with Llama's module names (what SmoothQuant's mappings match), in
    plain torch: importing transformers costs each spawned rank ~8 s."""

    def __init__(self, width=16, hidden=32, vocab=32):
        super().__init__()
        lin = torch.nn.Linear
        self.embed = torch.nn.Embedding(vocab, width)
        self.input_layernorm = torch.nn.RMSNorm(width)
        self.self_attn = torch.nn.ModuleDict({n: lin(width, width, bias=False)
                                              for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.post_attention_layernorm = torch.nn.RMSNorm(width)
        self.mlp = torch.nn.ModuleDict({"gate_proj": lin(width, hidden, bias=False),
                                        "up_proj": lin(width, hidden, bias=False),
                                        "down_proj": lin(hidden, width, bias=False)})

    def forward(self, ids):
        x = self.embed(ids)
        h, a = self.input_layernorm(x), self.self_attn
        attn = torch.softmax(a.q_proj(h) @ a.k_proj(h).transpose(-1, -2), -1) @ a.v_proj(h)
        x = x + a.o_proj(attn)
        h, m = self.post_attention_layernorm(x), self.mlp
        return x + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


def _scenarios(r, w, group=None):
    out = {}
    fams = _families()
    for n_batches in (w + 2, 1):  # ranks with different counts; ranks with no batches
        batches = _batches(n_batches, seed=n_batches)
        mine = qd.shard(batches, group)
        for sname, spec in _specs().items():
            for fam, opts in fams.items():
                key = f"{fam}/{sname}/b{n_batches}"
                obs = quantscope.get_observer(fam, spec, **opts)
                for x in mine:
                    obs(x)
                obs.sync(group)
                got = _record(obs)
                avg = any(isinstance(it, tuple) and it[1] is qd.AVG for it in qsync._plan(obs))
                if fam == "memoryless_minmax":  # by definition: the ranks' last tensors together
                    lasts = [batches[i::w][-1] for i in range(w) if batches[i::w]]
                    ref = quantscope.get_observer(fam, spec, **opts)
                    ref(torch.cat(lasts))
                elif avg:  # moving averages, default mode: the mean of the per-rank states
                    ref = None
                    lo, hi = [], []
                    for i in range(w):
                        part = batches[i::w]
                        if part:
                            o = quantscope.get_observer(fam, spec, **opts)
                            for x in part:
                                o(x)
                            lo.append(o.calculate_range()[0])
                            hi.append(o.calculate_range()[1])
                    ref_range = (sum(lo) / len(lo), sum(hi) / len(hi))
                    out[key + "/range"] = {"got": obs.calculate_range(), "ref": ref_range}
                else:
                    ref = quantscope.get_observer(fam, spec, **opts)
                    for x in batches:
                        ref(x)
                if ref is not None:
                    out[key] = {"got": got, "ref": _record(ref)}

                # exact step-synced mode: one process observing each step's concatenation
                if fam == "static_minmax":
                    continue
                obs = quantscope.get_observer(fam, spec, **opts)
                obs.sync_every_step, obs.sync_group = True, group
                ref = quantscope.get_observer(fam, spec, **opts)
                steps = -(-n_batches // w)
                for t in range(steps):
                    idx = t * w + r
                    if idx < n_batches:
                        obs(batches[idx])
                    elif sname == "tensor_sym":  # no data this step: both ways take part
                        qd.empty_step([obs], group)
                    else:
                        obs(batches[0][:0])
                    ref(torch.cat(batches[t * w:(t + 1) * w]))
                obs.sync()
                out[key + "/step"] = {"got": _record(obs), "ref": _record(ref)}

    # histogram counts: bitwise equal to one process, signed and |x|, with empty ranks
    for n_batches in (w + 2, 1):
        batches = _batches(n_batches, seed=20 + n_batches)
        for sname, spec in _specs().items():
            for absolute in (False, True):
                obs, ref = _HistObserver(spec, absolute=absolute), _HistObserver(spec,
                                                                                  absolute=absolute)
                for x in qd.shard(batches, group):
                    obs(x)
                for x in batches:
                    ref(x)
                obs.sync(group)
                out[f"hist/{sname}/{absolute}/b{n_batches}"] = {
                    "got": {**obs.state(), "tokens": obs.observed_tokens},
                    "ref": {**ref.state(), "tokens": ref.observed_tokens}}

    # an |x| and a signed histogram of one bin count in ONE sync (one batch of the grid
    # all-reduce): each re-binned on its own kind of grid (|x| from zero, x from its lo's bin)
    batches = _batches(w + 2, seed=23)
    spec = next(iter(_specs().values()))
    both, refs = ([_HistObserver(spec, absolute=a) for a in (True, False)] for _ in range(2))
    for x in qd.shard(batches, group):
        for obs in both:
            obs(x)
    for x in batches:
        for ref in refs:
            ref(x)
    qd.sync_observers(both, group)
    for obs, ref in zip(both, refs):
        out[f"hist_together/{obs.absolute}"] = {
            "got": {**obs.state(), "tokens": obs.observed_tokens},
            "ref": {**ref.state(), "tokens": ref.observed_tokens}}

    # the seeds' flags: Horizon is_sync_quantize (each rank's own EMA, MIN / MAX of the
    # averaged ends at read time) and llm-compressor's sync_activation_stats (static MIN /
    # MAX, minmax AVG)
    from quantscope.compat import horizon
    from quantscope.compat import llmcompressor_legacy as llmcompressor  # the seed's API

    batches = _batches(w + 1, seed=5)

    def horizon_pair(make):
        obs = make(is_sync_quantize=True)
        obs.sync_group = group
        refs = [make() for _ in range(w)]  # every rank's own EMA, in this process
        for i, x in enumerate(batches):
            refs[i % w](x)
            if i % w == r:
                obs(x)
        ends = [torch.stack([getattr(o, n) for o in refs]) for n in obs.end_names]
        for name, e, pick in zip(obs.end_names, ends, (torch.amin, torch.amax)):
            setattr(refs[0], name, pick(e, dim=0))
        return {"got": obs.calculate_qparams(), "ref": refs[0].calculate_qparams()}

    out["horizon"] = horizon_pair(lambda **kw: horizon.MovingAveragePerChannelMinMaxObserver(
        ch_axis=2, averaging_constant=0.2, **kw))
    out["horizon_percentile"] = horizon_pair(lambda **kw: horizon.PercentileObserver(
        bins=128, averaging_constant=0.3, **kw))
    args = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}
    lc = llmcompressor.StaticMinMaxObserver("input", args)
    lc.sync_group = group
    lc_ref = llmcompressor.StaticMinMaxObserver("input", args)
    for x in batches:
        lc_ref(x.reshape(-1, 8))
    for x in qd.shard(batches, group):
        lc(x.reshape(-1, 8))
    assert lc.sync_activation_stats() == []
    out["llmcompressor"] = {"got": lc.get_qparams(), "ref": lc_ref.get_qparams()}

    # many observers in one sync: a handful of collectives
    many = [quantscope.get_observer("static_minmax", QuantSpec(layout=Channel(-1)))
            for _ in range(20)]
    for o in many:
        for x in qd.shard(_batches(w + 1, seed=7), group):
            o(x)
    qd.sync_observers(many, group)
    out["many"] = {"stats": qd.last_stats()}

    # different observers on different ranks: the same error everywhere, no hang
    extra = [quantscope.get_observer("static_minmax", QuantSpec())] * (r == 0)
    try:
        qd.sync_observers(many[:2] + extra, group)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)

    # step-synced observers given other unit counts on each rank: one error everywhere (the
    # min-max family's range exchange aborted gloo: SIGABRT, found by probing)
    for family in ("minmax", "percentile"):
        obs = quantscope.get_observer(family, QuantSpec(layout=Channel(-1)))
        obs.sync_every_step, obs.sync_group = True, group
        try:
            obs(torch.randn(4, 16 if r == 0 else 8))
            out[f"units_{family}"] = None
        except ValueError as e:
            out[f"units_{family}"] = str(e)

    # Horizon's EMA histogram mode with an interval left unfinished: each rank folded its
    # own batches in after the sync, so the ranks disagreed (found by probing)
    def ema():
        return quantscope.get_observer("percentile", QuantSpec(), bins=128,
                                       averaging_constant=0.5, update_interval=2)

    own, synced = ema(), ema()
    for x in qd.shard(_batches(2 * w + 1, seed=11), group):
        own(x)
        synced(x)
    synced.sync(group)
    out["ema_hist"] = {"own": own.calculate_range(), "synced": synced.calculate_range()}

    # syncing again (found by probing: each sync summed the token counters once more):
    # nothing new is a no-op; batches observed since add only each rank's increments; a
    # histogram observed since its sync, or a reset on some ranks only, raises everywhere
    batches = _batches(2 * w, seed=13)
    for fam in ("static_minmax", "minmax", "percentile"):
        obs = quantscope.get_observer(fam, QuantSpec(layout=Channel(-1)), **fams[fam])
        ref = quantscope.get_observer(fam, QuantSpec(layout=Channel(-1)), **fams[fam])
        step = fam == "minmax"  # exact moving average: every rank's batch of a step together
        obs.sync_every_step, obs.sync_group = step, group
        for part in (batches[:w], batches[w:]):
            obs(part[r])
            for x in [torch.cat(part)] if step else part:
                ref(x)
            try:
                obs.sync(group)
                obs.sync(group)
                out[f"again/{fam}/{len(out)}"] = {"got": _record(obs), "ref": _record(ref)}
            except ValueError as e:
                out[f"again/{fam}/{len(out)}"] = str(e)
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    obs(batches[r])
    obs.sync(group)
    if r == 0:
        obs.reset()
        obs(batches[0])
    try:
        obs.sync(group)
        out["again/reset"] = None
    except ValueError as e:
        out["again/reset"] = str(e)

    # NaN on one rank: the same error on every rank, no hang
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    x = _batches(1, seed=3)[0]
    if r == w - 1:
        x = x.clone()
        x[0, 0, 0] = float("nan")
    obs(x)
    obs.sync(group)
    out["nan"] = _record(obs)
    obs = quantscope.get_observer("minmax", QuantSpec())
    obs.sync_every_step, obs.sync_group = True, group
    obs(x)
    obs.sync()
    out["nan_step"] = _record(obs)

    # step sync of tensors large enough for the min-max family's direct path, which takes
    # lo / hi without the units: it passed no units, read as "no data on this rank" (every
    # rank: TypeError; found by review), fp32 and bf16 (read by the kernel as they are)
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(40)
        xs = [(torch.randn(64, 2048, generator=g) * (i + 1)).to(dtype) for i in range(w)]
        obs = quantscope.get_observer("minmax", QuantSpec(layout=Channel(-1)))
        obs.sync_every_step, obs.sync_group = True, group
        ref = quantscope.get_observer("minmax", QuantSpec(layout=Channel(-1)))
        obs(xs[r])
        ref(torch.cat(xs))
        obs.sync()
        out[f"direct/{dtype}"] = {"got": _record(obs), "ref": _record(ref)}

    # calibration helpers: a failure on one rank raises on every rank; counts; samples
    try:
        with qd.all_or_none("observing", group):
            if r == w - 1:
                raise ValueError("boom")
        out["all_or_none"] = None
    except (ValueError, RuntimeError) as e:
        out["all_or_none"] = f"{type(e).__name__}: {e}"
    out["all_sum"] = qd.all_sum(r + 1, group)
    rows = [torch.full((2 + r, 3), float(r))] if r else []
    out["samples"] = qd.gather_samples({"a": rows, "none": []}, limit=4, group=group)

    # calibrate(..., distributed=True): shards, weight split, sync == one process on all
    from quantscope.calibration import calibrate

    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 4))
    batches = _batches(w + 2, seed=9, shape=(2, 3, 8))

    def qps(c):
        return {f"{layer}/{role}": st.qparams.scale for layer, roles in c.states.items()
                for role, st in roles.items()}

    weights = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    calls = []
    forward = quantscope.Observer.forward

    def counting(self, x):  # counts weight observations on this rank
        calls.append(x.data_ptr() in weights)
        return forward(self, x)

    quantscope.Observer.forward = counting
    try:
        calibrate(model, batches, "w8a8", observer="static_minmax", progress=False,
                  distributed=True, group=group)
    finally:
        quantscope.Observer.forward = forward
    out["weight_calls"] = sum(calls)
    for name in ("static_minmax", "percentile"):
        got = calibrate(model, batches, "w8a8", observer=name, progress=False, distributed=True,
                        group=group)
        ref = calibrate(model, batches, "w8a8", observer=name, progress=False)
        out[f"calib/{name}"] = {"got": qps(got), "ref": qps(ref)}
    got = calibrate(model, batches, "w8a8", observer="auto", progress=False, distributed=True,
                    group=group, candidates=["static_minmax", "percentile", "memoryless_mse"])
    out["calib_auto"] = {"got": qps(got), "observers": {
        f"{layer}/{role}": st.observer for layer, roles in got.states.items()
        for role, st in roles.items()}, "processes": got.info.get("processes")}

    # weights split by size: each rank observes its share, qparams are shared
    g = torch.Generator().manual_seed(11)
    weights = {f"layer{i}": torch.randn(4 + 3 * i, 16, generator=g) for i in range(7)}
    owner = qd.assign_by_size({k: v.numel() for k, v in weights.items()}, group=group)
    local = {}
    for name, wt in weights.items():
        if owner[name] == r:
            o = quantscope.get_observer("memoryless_minmax", QuantSpec(layout=Channel(0)))
            o(wt)
            local[name] = o.calculate_qparams()
    merged = qd.gather_qparams(local, group)
    ref = {}
    for name, wt in weights.items():
        o = quantscope.get_observer("memoryless_minmax", QuantSpec(layout=Channel(0)))
        o(wt)
        ref[name] = o.calculate_qparams()
    out["weights"] = {"got": {k: v.scale for k, v in merged.items()},
                      "ref": {k: v.scale for k, v in ref.items()}, "owner": owner}

    # SmoothQuant's channel ranges: each rank its shard, one collective for all mappings
    from quantscope import comm
    from quantscope.calibration.choice import smooth as sm

    torch.manual_seed(0)
    llama = _LlamaShaped().eval()
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 32, (1, 6), generator=g) for _ in range(2 * w)]
    maps = sm.find_mappings(llama)
    comm.reset_stats()
    got = sm.channel_ranges(llama, ids[r::w], maps, distributed=True, group=group)
    out["smooth_ranges"] = {"got": got, "ref": sm.channel_ranges(llama, ids, maps),
                            "collectives": comm.last_stats().collectives}
    return out


def _worker(r, w, port, tmp):
    """World ``w`` (3): the 2-process scenarios on the subgroup of ranks 0 and 1 first
    (one spawn, since starting a process and importing torch costs seconds), then the
    3-process scenarios on the whole group."""
    torch.set_num_threads(1)  # 3 processes on 2 cores: no oversubscription
    out = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r,
                                world_size=w, timeout=datetime.timedelta(seconds=60))
        pair = dist.new_group([0, 1])
        if r < 2:
            out[2] = _scenarios(r, 2, pair)
        out[w] = _scenarios(r, w)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes back to the parent
        out["crash"] = traceback.format_exc()
    torch.save(out, os.path.join(tmp, f"rank{r}.pt"))


def _cpu_ticks(pids) -> int | None:
    """CPU ticks used so far by ``pids`` and every descendant (live or reaped), from /proc;
    None where there is no /proc."""
    table = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for e in entries:
        try:
            with open(f"/proc/{e}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        # after the name: state, ppid, ..., utime stime cutime cstime at 11..14
        table[int(e)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    total, todo, seen = 0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in table:
            continue
        seen.add(pid)
        total += table[pid][1]
        todo.extend(c for c, (ppid, _) in table.items() if ppid == pid)
    return total


def _wait_progressing(done, pids, kill, what: str) -> None:
    """Poll ``done()`` until it is true; fail when ``pids`` made no CPU progress for STALL
    seconds (without /proc: after 30 minutes)."""
    import time

    last, since = _cpu_ticks(pids), time.monotonic()
    while not done():
        ticks = _cpu_ticks(pids)
        if ticks is None or ticks != last:
            last, since = ticks, (since if ticks is None else time.monotonic())
        stall = 1800 if ticks is None else STALL
        if time.monotonic() - since > stall:
            kill()
            raise AssertionError(f"{what}: no CPU progress for {stall} s (hang?)")


def _exited(p) -> bool:
    try:
        p.wait(timeout=1)
    except subprocess.TimeoutExpired:
        return False
    return True


def _spawn(w):
    with tempfile.TemporaryDirectory() as tmp:
        ctx = start_ranks(_worker, (w, free_port(), tmp), w)

        def kill():
            for p in ctx.processes:
                p.kill()

        _wait_progressing(lambda: ctx.join(timeout=1), [p.pid for p in ctx.processes], kill,
                          f"{w} spawned processes")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(w)]


@pytest.fixture(scope="module")
def spawned():
    res = _spawn(3)
    for r, out in enumerate(res):
        assert "crash" not in out, f"rank {r}:\n{out['crash']}"
    return res


@pytest.fixture(params=[2, 3])
def results(request, spawned):
    w = request.param
    return w, [spawned[r][w] for r in range(w)]


def _same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)
    elif isinstance(a, (tuple, list)):
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_qparams_equal_single_process(results):
    w, res = results
    keys = [k for k in res[0] if "/" in k and not k.endswith("/range")
            and not k.startswith("again/")]
    assert len(keys) >= 12
    for k in keys:
        for r in range(w):
            entry = res[r][k]
            assert str(entry["got"]) == str(res[0][k]["got"]), (k, r)  # every rank agrees
            assert "error" not in entry["got"], (k, entry["got"])
            if k.startswith("memoryless"):  # the reference saw only the last tensors
                entry = {s: {f: v for f, v in e.items() if f != "tokens"}
                         for s, e in entry.items()}
            try:
                _same(entry["got"], entry["ref"])  # bitwise, token counts included
            except AssertionError as e:
                raise AssertionError(f"{k} rank {r}: {e}") from None


def test_avg_mode_is_mean_of_rank_states(results):
    w, res = results
    keys = [k for k in res[0] if k.endswith("/range")]
    assert keys
    for k in keys:
        for r in range(w):
            (glo, ghi), (rlo, rhi) = res[r][k]["got"], res[r][k]["ref"]
            torch.testing.assert_close(glo, rlo, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ghi, rhi, rtol=1e-6, atol=1e-7)


def test_many_observers_few_collectives(results):
    _, res = results
    s = res[0]["many"]["stats"]
    # plan check + header all_gather + one MAX bucket (float32 min/max) + one SUM bucket
    assert s.collectives == 4
    assert s.bytes > 20 * 2 * 8 * 4


def test_different_observers_same_error_everywhere(results):
    w, res = results
    msgs = [res[r]["mismatch"] for r in range(w)]
    assert all(m is not None and "different observers" in m for m in msgs), msgs


def test_step_sync_of_other_unit_counts_is_one_error_everywhere(results):
    w, res = results
    for family in ("minmax", "percentile"):
        msgs = [res[r][f"units_{family}"] for r in range(w)]
        assert all(m is not None and "between 8 and 16 units" in m for m in msgs), msgs


def test_ema_histogram_syncs_the_mean_of_the_ranks_own_averages(results):
    w, res = results
    lo, hi = res[0]["ema_hist"]["synced"]
    for r in range(w):
        assert all(torch.equal(a, b) for a, b in zip(res[r]["ema_hist"]["synced"], (lo, hi)))
    for got, k in ((lo, 0), (hi, 1)):
        want = torch.stack([res[r]["ema_hist"]["own"][k] for r in range(w)]).mean(0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_sync_again_adds_only_what_is_new(results):
    w, res = results
    for r in range(w):
        for fam in ("static_minmax", "minmax", "percentile"):
            first, later = (v for k, v in res[r].items() if k.startswith(f"again/{fam}/"))
            _same(first["got"], first["ref"])
            if fam == "percentile":  # observed since its sync
                assert isinstance(later, str) and "observed after its last sync" in later, later
            else:
                _same(later["got"], later["ref"])
        msg = res[r]["again/reset"]
        assert msg is not None and "on some ranks only" in msg, msg


def test_nan_on_one_rank_same_error_everywhere(results):
    w, res = results
    for key in ("nan", "nan_step"):
        msgs = [res[r][key].get("error") for r in range(w)]
        assert all(m is not None and "NaN" in m for m in msgs), msgs
        assert len(set(msgs)) == 1


def test_seed_flags(results):
    w, res = results
    for r in range(w):
        _same(res[r]["horizon"]["got"], res[r]["horizon"]["ref"])
        _same(res[r]["horizon_percentile"]["got"], res[r]["horizon_percentile"]["ref"])
        _same(res[r]["llmcompressor"]["got"], res[r]["llmcompressor"]["ref"])


def test_weight_split_balanced_and_shared(results):
    w, res = results
    for r in range(w):
        _same(res[r]["weights"]["got"], res[r]["weights"]["ref"])
    owner = res[0]["weights"]["owner"]
    assert set(owner.values()) == set(range(w))


# ------------------------------------------------------------------ single process
def test_no_process_group_is_a_no_op():
    obs = quantscope.get_observer("static_minmax", QuantSpec())
    x = torch.randn(4, 8)
    obs(x)
    before = obs.calculate_qparams()
    obs.sync()
    qd.sync_observers([obs])
    after = obs.calculate_qparams()
    assert torch.equal(before.scale, after.scale)
    assert qd.shard(list(range(5))) == [0, 1, 2, 3, 4]


def test_assign_by_size_balances():
    sizes = {f"w{i}": s for i, s in enumerate([100, 90, 50, 40, 30, 20, 10, 5])}
    owner = qd.assign_by_size(sizes, world=3)
    loads = [sum(sizes[k] for k, v in owner.items() if v == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes.values()) // 2
    assert owner == qd.assign_by_size(dict(reversed(list(sizes.items()))), world=3)


def test_undeclared_observer_errors():
    class Bare(quantscope.Observer):
        def _observe(self, units, lo, hi):
            pass

    with pytest.raises(NotImplementedError, match="_sync_plan"):
        qsync._plan(Bare(QuantSpec(layout=Tensor())))


def test_calibration_helpers(results):
    w, res = results
    for r in range(w):
        msg = res[r]["all_or_none"]
        if r == w - 1:
            assert msg == "ValueError: boom"
        else:
            assert msg.startswith("RuntimeError") and f"[{w - 1}]" in msg, msg
        assert res[r]["all_sum"] == w * (w + 1) // 2
        (got,) = res[r]["samples"]["a"]
        assert res[r]["samples"]["none"] == []
        want = torch.cat([torch.full((2 + i, 3), float(i)) for i in range(1, w)])[:4]
        assert torch.equal(got, want)


def test_smooth_ranges_across_ranks_equal_one_process(results):
    w, res = results
    for r in range(w):
        got, ref = res[r]["smooth_ranges"]["got"], res[r]["smooth_ranges"]["ref"]
        assert got.keys() == ref.keys() and len(got) == 3
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        assert res[r]["smooth_ranges"]["collectives"] == 1


def test_calibrate_distributed_same_on_every_rank(results):
    w, res = results
    calls = [res[r]["weight_calls"] for r in range(w)]  # 3 Linear weights, split by size
    assert sum(calls) == 3 and min(calls) >= 1, calls
    assert res[0]["calib_auto"]["processes"] == w
    assert len(res[0]["calib/static_minmax"]["got"]) == 6  # 3 layers x (weight, input)
    for r in range(w):
        _same(res[r]["calib_auto"]["got"], res[0]["calib_auto"]["got"])
        assert res[r]["calib_auto"]["observers"] == res[0]["calib_auto"]["observers"]


@pytest.mark.extended  # spawns its own process group (torchrun)
def test_torchrun_cli_matches_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m quantscope calibrate`` on a tiny BERT (MiniLM's
    tokenizer): rank 0 alone writes, and the qparams equal those of one process."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    model_dir = bert_folder(tmp_path / "tiny", num_hidden_layers=2)
    args = ["calibrate", "--model", str(model_dir), "--recipe", "w8a8", "--observer",
            "percentile", "--calib-docs", "8", "--max-length", "32", "--eval-max-length", "32",
            "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "quantscope",
           *args, "--out", str(tmp_path / "run2")]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _wait_progressing(lambda: _exited(p), [p.pid], p.kill, "torchrun")
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert p.returncode == 0, stderr[-3000:]
    assert stdout.count("quantscope calibrate:") == 1  # the summary: rank 0 only
    from quantscope.cli import main

    assert main([*args, "--out", str(tmp_path / "run1")]) == 0  # one process, here
    runs = {n: safetensors.load_file(str(tmp_path / f"run{n}" / "qparams" /
                                         "qparams.safetensors")) for n in (1, 2)}
    assert runs[1].keys() == runs[2].keys() and len(runs[1]) > 0
    for k in runs[1]:
        assert torch.equal(runs[1][k], runs[2][k]), k
