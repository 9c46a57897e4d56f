"""Deterministic data partitioning on the rank side.

Every rank, and anyone checking coverage, computes the same permutation for an epoch:
``epoch_permutation(n, seed, epoch)`` is NumPy's PCG64 stream seeded with ``seed + epoch``
(PCG64 output is stable across NumPy versions by NumPy's policy), so a plan
``(offset, size)`` names the same samples everywhere. Batches are fetched with the dataset's
batched ``__getitems__`` when it has one, a single tensor index for ``TensorDataset``, and
per-sample indexing plus ``default_collate`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset, default_collate


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
