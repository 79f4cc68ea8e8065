"""Process groups, the local launcher, counted collectives, the sequence-parallel layout primitives,
the layer plan and the communicator that applies it."""

from spmoe.distributed.comm import CommStats, count_collectives
from spmoe.distributed.groups import (
    ParallelState,
    destroy_distributed,
    get_parallel_state,
    init_distributed,
)
from spmoe.distributed.launcher import RankFailed, Stopped, launch, spawn
from spmoe.distributed.layout import (
    Layout,
    _all_gather_sp_states,
    _restore_full_token_layout_if_needed,
    shard_rows,
    sp_all_gather,
    sp_reduce_scatter,
    sp_shard,
)

__all__ = [
    "CommStats",
    "Layout",
    "ParallelState",
    "RankFailed",
    "Stopped",
    "_all_gather_sp_states",
    "_restore_full_token_layout_if_needed",
    "count_collectives",
    "destroy_distributed",
    "get_parallel_state",
    "init_distributed",
    "launch",
    "shard_rows",
    "spawn",
    "sp_all_gather",
    "sp_reduce_scatter",
    "sp_shard",
]
