"""The control plane's host objects: `broadcast_object` from rank 0 and `gather_object` to rank 0 over the
gloo control group, uneven sizes included, and outside the counted collectives (the model's path)."""

import torch

from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.distributed.comm import broadcast_object, gather_object


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
