"""Statistics sync across processes on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Data-parallel calibration gives each process different batches; before
qparams are computed the observers must agree. Every observer declares how its
state reduces in :meth:`Observer.sync_plan` (``{buffer name: MIN | MAX | SUM | AVG}``,
or a :class:`CustomSync` such as a histogram that first agrees on a common grid);
:func:`sync_observers` then syncs any number of observers in a handful of
collectives:

0. one tiny ``all_reduce`` checking that every rank syncs the same observers (class,
   spec, bins, sync plan; a rank passing none takes part too) and that the local planning succeeded
   everywhere: an error on one rank (a header it cannot encode, a histogram folding its last batches
   into its average) raises on every rank, the same exception type and message;
1. one ``all_gather`` of a small fixed-length int64 header per rank (whether the
   observer saw data, whether it saw NaN / inf, the state shapes), so that a rank
   with no batches learns the shapes and fills its state with the identity of each
   reduction (+inf for MIN, -inf for MAX, 0 for SUM), and every rank reaches the
   same decision (including the same error) without a further exchange;
2. one ``all_reduce`` of the grid parameters of every custom sync (histograms), if any;
3. one ``all_reduce`` per (reduction, dtype) bucket: buffers are flattened and
   concatenated; MIN is folded into MAX by reversing the order (exact: ``-v`` for floats,
   ``~v`` for integers and bools), AVG into SUM.

Exactness. MIN / MAX / SUM states (static min-max, histogram counts, token counts)
after sync equal, bitwise, those of one process that saw every batch: min and
max are exact in any order and histogram counts are int64. Moving averages are
order-dependent, so two modes:

* default, approximate (as llm-compressor's DDP sync): AVG of the final per-rank
  averages, over the ranks that saw data. Cheap, one collective, no sync in forward.
* ``observer.sync_every_step = True``: exact. At every call the observers of all
  ranks exchange the step's statistic before updating their state, so the result
  equals, bitwise, one process that observed at each step the concatenation (along
  the batch) of every rank's batch of that step. Min-max observers exchange only the
  per-unit min / max (2 small collectives per call); every other observer gathers the
  step's units from all ranks (moves the activations). This puts collectives inside
  ``forward``: every rank must call every step-synced observer the same number of
  times in the same order; a rank without data for a step calls it with an empty
  tensor (``observer(x[:0])``) or :func:`empty_step`. After the last step
  :func:`sync_observers` only adds up the counters of step-synced observers.

NaN / inf. The "seen non-finite" flag travels in the header (MAX), so after a sync
every rank raises the same ``ValueError`` from ``calculate_qparams`` instead of one
rank raising while the others wait in a collective.

Outside an initialised process group (or with one process) every function here is
a no-op, so code written for ``torchrun`` also runs in a single process.

Where it lives (this module re-exports every name, the public entry point):
:mod:`quantscope.comm` (process-group helpers, the ``Op`` vocabulary, ``CustomSync``),
:mod:`quantscope.observers.sync` (``sync_observers``, ``step_sync``, ``empty_step``),
:mod:`quantscope.stats.histogram_sync` (``HistogramSync``) and
:mod:`quantscope.calibration.run.gather` (``weight_owners``, ``gather_samples``, ...).
"""

from __future__ import annotations

from .calibration.run.gather import (
    assign_by_size,
    gather_failures,
    gather_qparams,
    gather_samples,
    weight_owners,
)
from .comm import (
    AVG,
    MAX,
    MIN,
    SUM,
    CustomSync,
    Op,
    SyncStats,
    all_or_none,
    all_sum,
    init_from_env,
    is_distributed,
    is_main,
    last_stats,
    rank,
    shard,
    world_size,
)
from .observers.sync import empty_step, step_sync, sync_observers
from .stats.histogram_sync import HistogramSync

__all__ = [
    "AVG",
    "MAX",
    "MIN",
    "SUM",
    "CustomSync",
    "HistogramSync",
    "Op",
    "SyncStats",
    "all_or_none",
    "all_sum",
    "assign_by_size",
    "empty_step",
    "gather_failures",
    "gather_qparams",
    "gather_samples",
    "init_from_env",
    "is_distributed",
    "is_main",
    "last_stats",
    "rank",
    "shard",
    "step_sync",
    "sync_observers",
    "weight_owners",
    "world_size",
]
