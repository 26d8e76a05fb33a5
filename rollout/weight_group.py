"""The weight-update process group of SGLang's `init_weights_update_group` contract, built the same
way on both ends: the trainer (rank 0, `trainer_bridge.weight_sync`) and every engine process
(rank rank_offset + its DP rank, `rollout/core/weight_receiver.py`). Public: a trainer may build
it with this function."""
from __future__ import annotations

import datetime


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta):
    """A process group of its own (TCPStore rendezvous at init_method), never the default group, so
    it cannot clash with a trainer's own (DeepSpeed) group or the engine's DP group."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
