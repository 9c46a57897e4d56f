"""A failed session must not shift the store keys of the next one: torch names a default
process group by a per-process counter that a failed ``init_process_group`` advances, so a
rank that failed once more than its peer would wait on other keys than the peer writes,
in every later session (a livelock seen after a generator died during a rebuild)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed import PrefixStore

from ddpbus.worker_agent.trainer import restart_group_names


def _failed_session(store: dist.Store) -> None:
    with pytest.raises(dist.DistStoreError):  # its peer never comes
        dist.init_process_group("gloo", store=PrefixStore("pg/a/", store), rank=0,
                                world_size=2, timeout=timedelta(seconds=0.5))
    assert not dist.is_initialized()


def test_after_a_failed_session_the_next_group_is_named_like_a_fresh_processs() -> None:
    store = dist.HashStore()
    _failed_session(store)
    restart_group_names()
    dist.init_process_group("gloo", store=PrefixStore("pg/b/", store), rank=0, world_size=1)
    try:
        assert dist.group.WORLD.group_name == "0"  # what a peer that never failed uses
    finally:
        dist.destroy_process_group()


def test_without_the_restart_the_name_drifts() -> None:
    """The torch behaviour the restart guards against (if torch stops doing this, the
    guard is harmless, and this test says so)."""
    store = dist.HashStore()
    _failed_session(store)
    dist.init_process_group("gloo", store=PrefixStore("pg/c/", store), rank=0, world_size=1)
    try:
        assert dist.group.WORLD.group_name == "1"
    finally:
        dist.destroy_process_group()
        restart_group_names()
