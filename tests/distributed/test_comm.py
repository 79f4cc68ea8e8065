"""The control plane's host objects: `broadcast_object` from rank 0 and `gather_object` to rank 0 over the
gloo control group, uneven sizes included, and outside the counted collectives (the model's path)."""

import torch

from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.distributed.comm import all_reduce, broadcast_object, gather_object
from spmoe.distributed.simulated import SimulatedGroup


def exchange_objects():
    state = get_parallel_state()
    mine = {
        "rank": state.rank,
        "rows": [torch.full((state.rank, 2), float(state.rank))],
        "text": "x" * 50 * state.rank,
    }
    with count_collectives() as counted:
        plan = broadcast_object(
            {"step": 7, "ids": [1, 2, 3]} if state.rank == 0 else None, state.control_group
        )
        everyone = gather_object(mine, state.control_group)
    return plan, everyone, counted.as_dict()


def test_broadcast_and_gather_objects_reach_every_rank_in_order_uncounted():
    results = spawn(exchange_objects, 3)
    for rank, (plan, everyone, counted) in enumerate(results):
        assert plan == {"step": 7, "ids": [1, 2, 3]}
        assert sum(v["count"] for v in counted.values()) == 0
        if rank:
            assert everyone is None
    everyone = results[0][1]
    assert [o["rank"] for o in everyone] == [0, 1, 2]
    assert [o["text"] for o in everyone] == ["", "x" * 50, "x" * 100]
    assert all(
        torch.equal(o["rows"][0], torch.full((r, 2), float(r))) for r, o in enumerate(everyone)
    )


def test_a_nested_block_that_ends_stops_counting_itself_not_its_parent():
    group = SimulatedGroup("tp", 8)  # counted like a real group, no process needed
    with count_collectives() as outer:
        with count_collectives() as inner:  # equal to `outer` (both empty) when it ends
            pass
        all_reduce(torch.ones(4), group)
    assert outer.counts["all_reduce"]["count"] == 1
    assert inner.counts["all_reduce"]["count"] == 0
