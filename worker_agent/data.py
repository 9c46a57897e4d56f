"""Deterministic data partitioning on the rank side.

Every rank, and anyone checking coverage, computes the same permutation for an epoch:
``epoch_permutation(n, seed, epoch)`` is NumPy's PCG64 stream seeded with ``seed + epoch``
(PCG64 output is stable across NumPy versions by NumPy's policy), so a plan
``(offset, size)`` names the same samples everywhere. Batches are fetched with the dataset's
batched ``__getitems__`` when it has one, a single tensor index for ``TensorDataset``, and
per-sample indexing plus ``default_collate`` otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset, default_collate

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The shared permutation of ``range(n)`` for ``epoch``."""
    perm = np.random.Generator(np.random.PCG64(seed + epoch)).permutation(n).astype(np.int64)
    perm.setflags(write=False)
    return perm


def plan_indices(n: int, seed: int, plan_epoch: int, offset: int, size: int
                 ) -> np.ndarray[Any, np.dtype[np.int64]]:
    return epoch_permutation(n, seed, plan_epoch)[offset:offset + size]


class BatchFetcher:
    """Turns a batch of sample indices into the batch the user's train_step receives."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.collate = collate or default_collate
        self._tensor_dataset = isinstance(dataset, TensorDataset) and collate is None
        self._batched = hasattr(dataset, "__getitems__") and not self._tensor_dataset

    def __call__(self, indices: np.ndarray[Any, np.dtype[np.int64]]) -> Any:
        if self._tensor_dataset:
            index = torch.from_numpy(np.array(indices, dtype=np.int64))  # a writable copy
            return tuple(t[index] for t in self.dataset.tensors)
        items = (self.dataset.__getitems__(indices.tolist()) if self._batched
                 else [self.dataset[int(i)] for i in indices])
        return self.collate(items)


class Stager:
    """The rank's side of StageAdvisory: a dataset with a ``stage(indices)`` method (one
    reading from disk or the network, say) hears the sample indices an epoch's advised
    spans will read, in the advisory's walk order (this rank's own spans first, then the
    others', which it may be handed), from a background thread, to read them ahead while
    the rank trains. Latest wins: an advisory that comes while one is being staged waits
    for it and replaces any other waiting. A dataset without ``stage`` (in memory, like a
    TensorDataset) has nothing to read ahead; the advisory is still kept (``latest``)."""

    def __init__(self, dataset: Any) -> None:
        hook = getattr(dataset, "stage", None)
        self.hook: Callable[[np.ndarray[Any, np.dtype[np.int64]]], Any] | None = \
            hook if callable(hook) else None
        self.latest: Any = None  # the last StageAdvisory
        self.staged = 0  # indices handed to the hook so far
        self._waiting: np.ndarray[Any, np.dtype[np.int64]] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def advise(self, advisory: Any, *, dataset_size: int, seed: int) -> int:
        """Take one StageAdvisory; returns how many indices it names."""
        self.latest = advisory
        parts = [plan_indices(dataset_size, seed, seg.epoch, span.offset, span.size)
                 for seg in advisory.segments for span in seg.spans
                 if span.size > 0 and 0 <= span.offset <= dataset_size - span.size]
        walk = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if self.hook is None or walk.size == 0:
            return int(walk.size)
        with self._lock:
            self._waiting = walk
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ddpbus-stager",
                                                daemon=True)
                self._thread.start()
        return int(walk.size)

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        hook = self.hook
        while hook is not None:
            with self._lock:
                walk, self._waiting = self._waiting, None
                if walk is None:
                    return
            try:
                hook(walk)
                self.staged += int(walk.size)
            except Exception:  # a hint failed: training reads the samples as it would
                log.warning("the dataset's stage() failed; training goes on without it",
                            exc_info=True)


def pin(batch: Any) -> Any:
    """``batch`` with every CPU tensor in page-locked memory (a host-to-GPU copy from there
    can be ``non_blocking``: it overlaps the GPU's work instead of waiting for it)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory() if batch.device.type == "cpu" else batch
    if isinstance(batch, tuple | list):
        return type(batch)(pin(b) for b in batch)
    if isinstance(batch, dict):
        return {k: pin(v) for k, v in batch.items()}
    return batch


class Prefetcher:
    """The next ``depth`` batches of a rank's plans, fetched on one background thread while
    the training thread computes (``depth`` 0: fetched in the training thread, as needed).

    A plan's batches are known ahead: its indices are fixed, it is trained from the front
    batch by batch, and plans are only appended behind it or dropped once done. So the
    fetcher reads exactly the batches training will take, in the order it takes them; a
    batch asked for that was not fetched ahead (the first of a run, one after the plans
    changed) is fetched at once. ``pin_memory``: the batches land in page-locked memory
    (CUDA). A fetch that fails raises in the training thread, when that batch is taken.
    A plan is any object with ``indices``, ``batch_size``, ``pos``, ``ahead`` (the start of
    its next batch not yet asked for) and ``take()``."""

    def __init__(self, fetch: Callable[[np.ndarray[Any, np.dtype[np.int64]]], Any], *,
                 depth: int, pin_memory: bool = False) -> None:
        self.fetch = fetch
        self.depth = depth
        self.pin_memory = pin_memory
        self.ahead_hits = 0  # batches taken that had been fetched ahead
        # (plan, start) of each batch asked for, oldest first: the plan is held, so a
        # done plan's identity is never another's while its batches wait here
        self._pending: deque[tuple[Any, int, Future[Any]]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpbus-prefetch") \
            if depth > 0 else None

    def _load(self, indices: np.ndarray[Any, np.dtype[np.int64]]) -> Any:
        batch = self.fetch(indices)
        return pin(batch) if self.pin_memory else batch

    def take(self, plan: Any) -> Any:
        """The plan's next batch (``plan.take()`` advances it), fetched ahead if it was."""
        start = plan.pos
        indices = plan.take()
        plan.ahead = max(plan.ahead, plan.pos)
        while self._pending and not (self._pending[0][0] is plan
                                     and self._pending[0][1] == start):
            self._pending.popleft()[2].cancel()  # asked for, then the plans changed
        if self._pending:
            self.ahead_hits += 1
            return self._pending.popleft()[2].result()
        return self._load(indices)

    def ahead(self, plans: Iterable[Any]) -> None:
        """Ask for the batches after the ones taken, up to ``depth`` in flight."""
        if self._pool is None:
            return
        for plan in plans:
            plan.ahead = max(plan.ahead, plan.pos)
            while len(self._pending) < self.depth and \
                    plan.ahead + plan.batch_size <= len(plan.indices):
                indices = plan.indices[plan.ahead:plan.ahead + plan.batch_size]
                self._pending.append((plan, plan.ahead, self._pool.submit(self._load,
                                                                          indices)))
                plan.ahead += plan.batch_size
            if len(self._pending) >= self.depth:
                return

    def close(self) -> None:
        """Drop what was asked for; the thread ends after the fetch it is in, if any."""
        for *_, f in self._pending:
            f.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
