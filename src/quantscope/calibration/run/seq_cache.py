"""The activations sequential calibration (:mod:`.sequential`) caches per batch: each
block's hidden states (:class:`Cache`, in memory within a shared budget, else spilled to
files) and every block's other arguments (:class:`Contexts`); and SIGTERM unwinding the run
while it holds its spill folder, as Ctrl-C does (:func:`sigterm_unwinds`)."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from pathlib import Path

import torch

from .batches import map_tensors, tensors_in
from .block_order import fill, split_contexts

__all__ = ["Cache", "Contexts", "Terminated", "Unwinding", "sigterm_unwinds"]


class Cache:
    """Per-batch values (tensors, tuples and dicts of them) in memory while their total
    stays within the shared ``budget`` (bytes, a one-item list), else in files."""

    def __init__(self, budget: list, folder: str, tag: str):
        self.budget, self.folder, self.tag = budget, folder, tag
        self.mem, self.size, self.spilled = {}, {}, 0
        self.held: set[int] = set()  # the batches it holds, in memory or in files

    def put(self, i: int, value) -> None:
        self.drop(i)
        value = map_tensors(torch.Tensor.detach, value)
        nbytes = _nbytes(value)
        self.held.add(i)
        if nbytes <= self.budget[0]:
            self.mem[i], self.size[i] = value, nbytes
            self.budget[0] -= nbytes
            return
        path = os.path.join(self.folder, f"{self.tag}-{i}.pt")
        torch.save(map_tensors(_compact, value), path + ".tmp")
        os.replace(path + ".tmp", path)  # a file is whole or absent
        self.spilled += 1

    def get(self, i: int):
        if i in self.mem:
            return self.mem[i]
        # weights_only: the file holds tensors, tuples, dicts and plain values, and even our
        # own spill file is never unpickled as code (docs/SECURITY.md)
        return torch.load(os.path.join(self.folder, f"{self.tag}-{i}.pt"), weights_only=True)

    def drop(self, i: int) -> None:
        self.held.discard(i)
        if i in self.mem:
            del self.mem[i]
            self.budget[0] += self.size.pop(i)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.folder, f"{self.tag}-{i}.pt"))

    def clear(self) -> None:
        for i in list(self.mem):
            self.drop(i)
        for f in Path(self.folder).glob(f"{self.tag}-*.pt"):
            f.unlink()
        self.held.clear()


class Contexts:
    """Each block's arguments besides its hidden states, per batch: their distinct tensors
    in ``tensors`` (a :class:`Cache`: in memory or spilled, read back ``weights_only``),
    the rest in memory as templates (:func:`.block_order.split_contexts`): the first block's,
    and a block's own only where it differs. Anything besides tensors (flags, sizes, objects
    of the model's own) thus stays in memory, whatever the budget."""

    def __init__(self, tensors: Cache):
        self.tensors, self.templates = tensors, {}

    def put(self, i: int, trace) -> None:
        listed, first, own = split_contexts(trace)
        self.tensors.put(i, listed)
        self.templates[i] = (first, own)

    def get(self, j: int, i: int) -> tuple[tuple, dict]:
        first, own = self.templates[i]
        return fill(own.get(j, first), self.tensors.get(i))

    def clear(self) -> None:
        self.tensors.clear()
        self.templates.clear()


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it alone where it is a view of a larger storage: ``torch.save``
    writes a view's whole storage (a slice of a rotary table: the table, in every file),
    while the budget counts the view's bytes (:func:`_nbytes`). Not for a storage smaller
    than the view (zeros expanded: :func:`.block_order.free_zeros`), saved as it is."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def spill_folder(cache_dir) -> str:
    """A new spill folder in ``cache_dir`` (None: the system's temporary folder); one that
    cannot be made there (a read-only or special file system) is a ``ValueError`` naming it."""
    try:
        return tempfile.mkdtemp(prefix="quantscope-seq-", dir=cache_dir)
    except OSError as e:
        where = (f"Sequential.cache_dir {os.fspath(cache_dir)!r}" if cache_dir is not None
                 else f"the system's temporary folder {tempfile.gettempdir()!r}")
        raise ValueError(f"calibrate: cannot make the spill folder in {where} ({e.strerror});"
                         f" give Sequential(cache_dir=) a folder this process can write"
                         ) from None


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by :func:`sigterm_unwinds`'s handler: a
    BaseException, as KeyboardInterrupt, so that no ``except Exception`` stops it."""


class Unwinding:
    """What :func:`sigterm_unwinds` yields: ``fired``, a SIGTERM came; set ``quiet`` (a plain
    attribute store: no bytecode that runs a signal handler) as the first step of a cleanup,
    so a SIGTERM from then on waits for its end instead of cutting it short."""

    __slots__ = ("fired", "quiet")

    def __init__(self):
        self.fired, self.quiet = False, False


@contextlib.contextmanager
def sigterm_unwinds():
    """Inside, a SIGTERM (``kill``, ``timeout``, ``docker stop``, Slurm's preemption) raises
    :class:`Terminated`, so the ``finally`` blocks inside run (the spill folder removed);
    leaving, the handler as it was, and a SIGTERM that came delivers the signal again, so
    the process ends as it would have (by the signal, exit status -15). Only where SIGTERM's
    handler is the default one (ending the process at once) and on the main thread (the
    only one a handler can be set on); a handler of the program's own is left to decide. A
    second SIGTERM while unwinding is not raised again, nor a first once the yielded
    :class:`Unwinding` is ``quiet`` (the cleanup runs whole): it is the one delivered at the
    end."""
    state = Unwinding()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield state
        return

    def handler(signum, frame):
        first, state.fired = not state.fired, True
        if first and not state.quiet:
            raise Terminated("SIGTERM: the sequential calibration was stopped")

    try:  # (set inside: a SIGTERM right after it finds the finally that takes it back)
        signal.signal(signal.SIGTERM, handler)
        yield state
    finally:
        state.quiet = True
        if signal.getsignal(signal.SIGTERM) is handler:  # (not one set since: kept)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if state.fired:  # (raised or not: the process ends as SIGTERM ends it)
            signal.raise_signal(signal.SIGTERM)
