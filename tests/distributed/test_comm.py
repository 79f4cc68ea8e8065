"""Host-side results gathered through the counted collectives: every rank's object in rank order, uneven
sizes included, and both all-gathers counted."""

import torch

from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.distributed.comm import all_gather_object


def gather_objects():
    state = get_parallel_state()
    mine = {"rank": state.rank, "rows": [torch.full((state.rank, 2), float(state.rank))], "text": "x" * 50 * state.rank}
    with count_collectives() as counted:
        everyone = all_gather_object(mine, state.ep_group, state.device)
    return everyone, counted.as_dict()


def test_all_gather_object_returns_every_rank_in_order_and_is_counted():
    for everyone, counted in spawn(gather_objects, 3):
        assert [o["rank"] for o in everyone] == [0, 1, 2]
        assert [o["text"] for o in everyone] == ["", "x" * 50, "x" * 100]
        assert all(torch.equal(o["rows"][0], torch.full((r, 2), float(r))) for r, o in enumerate(everyone))
        assert counted["all_gather"]["count"] == 2  # the lengths, then the padded bytes
        assert sum(v["count"] for v in counted.values()) == 2
