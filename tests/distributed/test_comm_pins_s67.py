"""Pins of ``quantscope.comm`` (and the re-exports of ``quantscope.distributed``) that the
existing tests let through, from a mutation round (s67): every collective and every rank or
size question goes to the group it is given (not the default group), ``init_from_env``'s NCCL
device and an already-joined group, the identity of ``AVG``, the single-process fallbacks
of ``all_sum`` and ``is_writer``, the record a non-writer logs, and how a peer's exception is
encoded and rebuilt (a nested class, a class that takes no message, a module not imported
here). No process is spawned: ``torch.distributed`` is replaced by fakes that record the
group each call names, or the ranks are the threads of test_sync_pins_s64.py's ``_World``.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.distributed as dist
from test_sync_pins_s64 import ranks  # noqa: F401 -- ranks: the fixture

from quantscope import comm
from quantscope import distributed as qd
from quantscope.observers import sync as qsync

GROUP = object()  # a subgroup of 2 processes in a world of 8, where this process is rank 1


class _Outer:
    class Failure(Exception):
        """An exception class reached through a dotted ``__qualname__``."""


class _TwoArgs(Exception):
    """An exception class that cannot be built from one message."""

    def __init__(self, code, detail):
        super().__init__(code, detail)


@pytest.fixture
def grouped(monkeypatch):
    """``torch.distributed`` of 8 processes (this one global rank 5) with ``GROUP`` of 2 (this
    one its rank 1, NCCL); every collective records the group it names in the list returned."""
    seen = []

    def pick(group, in_group, default):
        return in_group if group is GROUP else default

    def record(name):
        def call(*args, group=None, **kwargs):
            seen.append((name, group))
            if name == "all_gather":
                for o in args[0]:
                    o.copy_(args[1])
            if name == "all_gather_object":
                args[0][:] = [None] * (len(args[0]) - 1) + [args[1]]
        return call

    for name, value in {
            "is_initialized": lambda: True,
            "get_world_size": lambda group=None: pick(group, 2, 8),
            "get_rank": lambda group=None: pick(group, 1, 5),
            "get_backend": lambda group=None: pick(group, "nccl", "gloo"),
            "all_reduce": record("all_reduce"), "all_gather": record("all_gather"),
            "all_gather_object": record("all_gather_object")}.items():
        monkeypatch.setattr(dist, name, value)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    return seen


# ------------------------------------------------------------------------ group handling
def test_rank_size_and_main_are_the_groups(grouped):
    assert comm.rank(GROUP) == 1 and comm.rank() == 5
    assert comm.world_size(GROUP) == 2 and comm.world_size() == 8
    assert comm.is_main(GROUP) is False
    assert comm.shard(range(6), GROUP) == [1, 3, 5]


def test_a_subgroup_of_one_process_is_not_distributed(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1 if group is GROUP else 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0 if group is GROUP else 3)
    assert comm.is_distributed(GROUP) is False and comm.is_distributed() is True
    assert comm.is_main(GROUP) is True and comm.is_main() is False


def test_group_device_is_the_groups_backend_on_this_processs_cuda_device(grouped):
    assert comm.group_device(GROUP) == torch.device("cuda", 1)
    assert comm.group_device(None) == torch.device("cpu")


def test_counted_collectives_run_in_the_group_given(grouped):
    comm.all_reduce(torch.zeros(2), dist.ReduceOp.MAX, GROUP)
    got = comm.all_gather(torch.arange(3), GROUP)
    assert got.tolist() == [[0, 1, 2]] * 2  # one row per process of the group, not the world
    assert grouped == [("all_reduce", GROUP), ("all_gather", GROUP)]


def test_all_sum_reduces_in_the_group_given(grouped, monkeypatch):
    monkeypatch.setattr(comm, "group_device", lambda group: torch.device("cpu"))
    assert comm.all_sum(3, GROUP) == 3  # the fake reduction leaves the value
    assert grouped == [("all_reduce", GROUP)]


def test_all_or_none_exchanges_its_flag_and_the_errors_in_the_group_given(grouped, monkeypatch):
    monkeypatch.setattr(comm, "group_device", lambda group: torch.device("cpu"))
    with comm.all_or_none("a step", GROUP):
        pass
    assert grouped == [("all_gather", GROUP)]
    grouped.clear()
    with pytest.raises(KeyError), comm.all_or_none("a step", GROUP):
        raise KeyError("local")
    assert grouped == [("all_gather", GROUP), ("all_gather_object", GROUP)]


# ----------------------------------------------------------------------- init_from_env
def test_init_from_env_on_cuda_joins_nccl_on_the_local_rank_device(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("device", d)))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert comm.init_from_env() is True
    assert calls == [("device", 1), "nccl"]
    calls.clear()
    assert comm.init_from_env("gloo") is True and calls == ["gloo"]  # no device for gloo


def test_init_from_env_in_a_joined_group_reports_it_and_joins_nothing(monkeypatch):
    """A group set up without torchrun's environment (``mp.spawn``): its size decides."""
    def join(*args, **kwargs):
        raise AssertionError("joined a second process group")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "init_process_group", join)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert comm.init_from_env() is True
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert comm.init_from_env() is False


# ------------------------------------------------------------- single-process fallbacks
def test_avg_states_of_an_idle_rank_hold_zero():
    """AVG is folded into SUM: its identity is SUM's 0, in every dtype."""
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        assert comm.AVG.identity(dtype) == 0


def test_all_sum_outside_a_group_is_a_plain_int():
    got = comm.all_sum(torch.tensor(7))
    assert type(got) is int and got == 7


def test_outside_a_group_every_calibration_is_written_here(caplog):
    with caplog.at_level(logging.DEBUG, logger="quantscope"):
        assert comm.is_writer(3) is True and comm.writes_here(0, "save", "out.pt") is True
    assert caplog.records == []


def test_the_non_writers_record_names_the_writer(monkeypatch, caplog):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with caplog.at_level(logging.INFO, logger="quantscope"):
        assert comm.writes_here(2, "export", "out") is False
    assert "writer_rank is global rank 2, which writes it" in caplog.records[0].getMessage()


def test_default_batch_key_keeps_each_custom_sync_alone():
    a, b = comm.CustomSync(), comm.CustomSync()
    assert a.batch_key(None) == a.batch_key(None) and a.batch_key(None) != b.batch_key(None)


# ------------------------------------------------------------------- peers' exceptions
def test_the_exchanged_error_is_the_tuple_of_type_names_and_str(monkeypatch):
    sent = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: sent.append(obj))
    with pytest.raises(_Outer.Failure):
        comm.raise_on_all(_Outer.Failure("it broke"), True, "a step")
    with pytest.raises(KeyError):
        comm.raise_on_all(KeyError("k"), True, "a step")
    assert sent == [(__name__, "_Outer.Failure", "it broke"), ("builtins", "KeyError", "'k'")]


def test_the_others_raise_the_first_failing_ranks_message_as_it_reads(ranks):  # noqa: F811
    w = ranks(3)

    def step(r):
        with comm.all_or_none("a step", same_type=True):
            if r == 2:
                raise ValueError("bad value")

    got = w.run(step)
    assert type(got[0]) is ValueError and type(got[1]) is ValueError
    assert str(got[0]) == str(got[1]) == "bad value (a step failed on rank(s) [2])"


def test_a_nested_exception_class_is_rebuilt_as_itself():
    got = comm._rebuilt(__name__, "_Outer.Failure", "it broke", " (where)")
    assert type(got) is _Outer.Failure and str(got) == "it broke (where)"


def test_a_class_that_takes_no_message_gives_a_runtime_error_naming_it():
    got = comm._rebuilt(__name__, "_TwoArgs", "it broke", " (where)")
    assert type(got) is RuntimeError
    assert str(got) == f"{__name__}._TwoArgs: it broke (where)"


def test_a_peers_module_is_never_imported_here(monkeypatch):
    monkeypatch.delitem(sys.modules, "tabnanny", raising=False)  # a module nothing here needs
    got = comm._rebuilt("tabnanny", "NannyNag", "it broke", "")
    assert type(got) is RuntimeError and str(got) == "tabnanny.NannyNag: it broke"
    assert "tabnanny" not in sys.modules


# ------------------------------------------------------------------------ re-exports
def test_distributed_re_exports_the_documented_names_as_themselves():
    from quantscope.calibration.run import gather

    for module in (comm, qsync, gather):
        for name in set(qd.__all__) & set(dir(module)):
            assert getattr(qd, name) is getattr(module, name), name
    assert {"all_or_none", "all_sum", "shard", "sync_observers", "step_sync", "empty_step",
            "HistogramSync", "weight_owners", "gather_samples", "CustomSync", "Op",
            "last_stats"} <= set(qd.__all__)
