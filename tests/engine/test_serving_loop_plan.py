"""`ServingLoop.plan` on rank 0: new requests go to the least loaded DP group, the n choices of a request
(new requests with one prompt) to one group, where they fork; aborts of requests that are not live are
dropped. Planning is pure bookkeeping, so a stand-in parallel state with DP 2 is enough here (the plans'
broadcast and every rank applying them run in the serving tests)."""

from types import SimpleNamespace

from spmoe.engine import ranks
from spmoe.engine.request import Request


def test_choices_of_one_prompt_go_to_one_dp_group(monkeypatch):
    monkeypatch.setattr(ranks, "get_parallel_state", lambda: SimpleNamespace(dp_size=2))
    loop = ranks.ServingLoop(engine=None)
    first = [Request(f"a-{i}", [1, 2, 3], 4) for i in range(3)] + [Request("b", [4, 5], 4)]
    plan = loop.plan(first, [])
    assert [(r.request_id, group) for r, group in plan.new] == [
        ("a-0", 0),
        ("a-1", 0),
        ("a-2", 0),
        ("b", 1),
    ]
    assert plan.command == "step"
    # later: the least loaded group again (group 1 holds one request, group 0 three)
    plan = loop.plan(
        [Request("c-0", [1, 2, 3], 4), Request("d", [6], 4), Request("c-1", [1, 2, 3], 4)], ["x"]
    )
    assert [(r.request_id, group) for r, group in plan.new] == [("c-0", 1), ("d", 1), ("c-1", 1)]
    assert plan.aborts == []  # "x" is not live
    plan = loop.plan([], ["a-0", "a-1", "a-2", "b", "c-0", "d", "c-1"], shutdown=True)
    assert len(plan.aborts) == 7 and plan.command == "shutdown" and not loop.has_live()
