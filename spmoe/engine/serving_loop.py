"""Driving every rank's engine through the same steps: the serving loop (`spmoe serve`) and the batch job
(`spmoe generate`, the demo).

Every rank of a TP group runs the same steps on the same requests; under DP every rank steps together (the
MoE dispatch spans all of them), a DP group with nothing to run taking an empty step.

The serving loop: rank 0 decides everything. Each iteration it plans a step (`StepPlan`: the new requests,
each given to the least loaded DP group, or with the prompt of another new one to that one's, the aborts, and
whether to step at all), sends the plan to every
rank over the gloo control group, and every rank applies it and runs the step; under DP > 1 TP rank 0 of each
DP group sends its outputs and metrics back to rank 0 (`ServingLoop.step`). The other ranks apply plans until
the shutdown (`worker_loop`).

The batch job knows its requests up front, so it needs no plan per step: each DP group adds its own share,
and every rank steps until no rank has work left (`run_to_completion`; with DP > 1 one tiny all-reduce per
step says whether any rank still has).
"""

from dataclasses import dataclass, field

import torch

from spmoe.distributed import get_parallel_state
from spmoe.distributed.comm import all_reduce, broadcast_object, gather_object
from spmoe.engine.request import EngineMetrics, Request, RequestOutput


@dataclass
class StepPlan:
    """One iteration of the serving loop, the same on every rank."""

    command: str  # "step" (run one engine step), "idle" (the heartbeat: nothing to run), "shutdown"
    new: list[tuple[Request, int]] = field(default_factory=list)  # requests and the DP group that runs each
    aborts: list[str] = field(default_factory=list)  # request ids


def apply_plan(engine, plan: StepPlan) -> tuple[list[RequestOutput], EngineMetrics] | None:
    """Apply the plan on this rank and run its step. -> on rank 0, every DP group's outputs and their metrics
    combined; None on the other ranks."""
    state = get_parallel_state()
    for request, dp_group in plan.new:
        if dp_group == state.dp_rank:
            engine.add_request(request)
    for request_id in plan.aborts:
        engine.abort(request_id)
    outputs = engine.step() if plan.command == "step" else []
    if state.dp_size == 1:
        return (outputs, engine.metrics()) if state.rank == 0 else None
    parts = gather_object((outputs, engine.metrics()) if state.tp_rank == 0 else None, state.control_group)
    if state.rank != 0:
        return None
    per_dp = parts[:: state.tp_size]  # TP rank 0 of each DP group
    return [out for outs, _ in per_dp for out in outs], EngineMetrics.combine([m for _, m in per_dp])


def worker_loop(engine) -> None:
    """Every rank but 0: apply rank 0's plans until the shutdown."""
    state = get_parallel_state()
    while True:
        plan = broadcast_object(None, state.control_group)
        apply_plan(engine, plan)
        if plan.command == "shutdown":
            return


class ServingLoop:
    """Rank 0's side of the serving loop: it plans each step and runs it on every rank."""

    def __init__(self, engine):
        self.engine = engine
        self.state = get_parallel_state()
        self.dp_of: dict[str, int] = {}  # live request -> its DP group

    def has_live(self) -> bool:
        return bool(self.dp_of)

    def plan(self, new: list[Request], aborts: list[str], shutdown: bool = False) -> StepPlan:
        """The next step: each new request goes to the least loaded DP group, but one whose prompt equals an
        earlier new request's goes to that one's group (the n choices of a request fork there, sharing the
        prompt's blocks); an abort of a request that is not live is dropped; the command is "step" while any
        request is live."""
        plan, group_of_prompt = StepPlan("idle"), {}
        for request in new:
            group = group_of_prompt.get(tuple(request.prompt))
            if group is None:
                load = [0] * self.state.dp_size
                for placed in self.dp_of.values():
                    load[placed] += 1
                group = group_of_prompt[tuple(request.prompt)] = load.index(min(load))
            self.dp_of[request.request_id] = group
            plan.new.append((request, group))
        for request_id in aborts:
            if self.dp_of.pop(request_id, None) is not None:
                plan.aborts.append(request_id)
        plan.command = "shutdown" if shutdown else "step" if self.dp_of else "idle"
        return plan

    def step(self, plan: StepPlan) -> tuple[list[RequestOutput], EngineMetrics]:
        """Send the plan to every rank and run it here. -> every DP group's outputs and metrics; finished
        requests are no longer live."""
        broadcast_object(plan, self.state.control_group)
        outputs, metrics = apply_plan(self.engine, plan)
        for out in outputs:
            if out.finish_reason is not None:
                self.dp_of.pop(out.request_id, None)
        return outputs, metrics


def run_to_completion(engine, on_step=None) -> None:
    """The batch job on every rank: step until no rank has work left, after each step calling `on_step()`.
    A request that ends with an error (non-finite logits) stops the job: FloatingPointError with its message."""
    while _any_rank_busy(engine.has_unfinished()):
        failed = [out.error for out in engine.step() if out.finish_reason == "error"]
        if failed:
            raise FloatingPointError(failed[0])
        if on_step is not None:
            on_step()


def _any_rank_busy(busy: bool) -> bool:
    """With DP > 1 every rank runs every step (the MoE dispatch spans all of them), so a DP rank that is done
    keeps stepping with an empty batch until every rank is done: one tiny all-reduce per step."""
    state = get_parallel_state()
    if state.dp_size == 1:
        return busy
    flag = torch.tensor([int(busy)], device=state.device)
    return bool(all_reduce(flag, state.ep_group, op="max").item())
