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

Which waiting requests join a step, and how many of their prompt tokens come from the prefix cache, is decided
on one rank of each DP group, its TP rank 0, and followed by the others, which never look a prompt up
themselves (`Scheduler.schedule(admissions)`): a rank whose cache cannot give what the decision reuses raises
instead of computing something else. Without DP, rank 0 schedules its step before sending the plan, and the
plan carries its admissions (`StepPlan.admissions`). Under DP, each DP group's TP rank 0 schedules after the
plan and sends its admissions to its TP peers over the group's gloo control group (`schedule_in_group`); so
does the batch job. That exchange happens only in a step where the group has waiting requests: with none
waiting (the ranks of a group agree on that, having admitted the same), the step admits nothing. The block ids
themselves need not travel: each rank's block tables address its own pool, and a rank finds the blocks to
reuse by the same chain hashes (`BlockManager.allocate(reuse=...)`).

The batch job knows its requests up front, so it needs no plan per step: each DP group adds its own share,
and every rank steps until no rank has work left (`run_to_completion`; with DP > 1 one tiny all-reduce per
step says whether any rank still has).
"""

from dataclasses import dataclass, field

import torch

from spmoe.distributed import get_parallel_state
from spmoe.distributed.comm import all_reduce, broadcast_object, gather_object
from spmoe.engine.request import EngineMetrics, Request, RequestOutput
from spmoe.engine.sequence import ScheduledBatch


@dataclass
class StepPlan:
    """One iteration of the serving loop, the same on every rank."""

    command: str  # "step" (run one engine step), "idle" (the heartbeat: nothing to run), "shutdown"
    new: list[tuple[Request, int]] = field(
        default_factory=list
    )  # requests and the DP group that runs each
    aborts: list[str] = field(default_factory=list)  # request ids
    # without DP, in a "step": the requests rank 0 admits and the prompt tokens each reuses from the prefix
    # cache, which every other rank follows; None under DP (each DP group's TP rank 0 decides for its group)
    admissions: list[tuple[str, int]] | None = None


def apply_requests(engine, plan: StepPlan) -> None:
    """This rank's DP group's new requests and the aborts of the plan, into its engine."""
    state = get_parallel_state()
    for request, dp_group in plan.new:
        if dp_group == state.dp_rank:
            engine.add_request(request)
    for request_id in plan.aborts:
        engine.abort(request_id)


def schedule_in_group(engine) -> ScheduledBatch | None:
    """This step's batch on every rank of a DP group: its TP rank 0 decides the admissions and sends them to
    the group's other ranks, which follow them. With nothing waiting nothing is admitted, and nothing sent."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return engine.schedule()
    if not engine.has_waiting():
        return engine.schedule([])
    first = state.dp_rank * state.tp_size  # the group's TP rank 0
    if state.tp_rank == 0:
        batch = engine.schedule()
        broadcast_object(
            batch.admissions if batch is not None else [], state.tp_control_group, src=first
        )
        return batch
    return engine.schedule(broadcast_object(None, state.tp_control_group, src=first))


def finish_step(
    engine, plan: StepPlan, batch: ScheduledBatch | None
) -> tuple[list[RequestOutput], EngineMetrics] | None:
    """Run the plan's scheduled batch on this rank. -> on rank 0, every DP group's outputs and their metrics
    combined; None on the other ranks."""
    state = get_parallel_state()
    outputs = engine.run(batch) if plan.command == "step" else []
    if state.dp_size == 1:
        return (outputs, engine.metrics()) if state.rank == 0 else None
    parts = gather_object(
        (outputs, engine.metrics()) if state.tp_rank == 0 else None, state.control_group
    )
    if state.rank != 0:
        return None
    per_dp = parts[:: state.tp_size]  # TP rank 0 of each DP group
    return [out for outs, _ in per_dp for out in outs], EngineMetrics.combine(
        [m for _, m in per_dp]
    )


def worker_loop(engine) -> None:
    """Every rank but 0: apply rank 0's plans until the shutdown."""
    state = get_parallel_state()
    while True:
        plan = broadcast_object(None, state.control_group)
        apply_requests(engine, plan)
        batch = None
        if plan.command == "step":
            batch = (
                schedule_in_group(engine)
                if plan.admissions is None
                else engine.schedule(plan.admissions)
            )
        finish_step(engine, plan, batch)
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
        """Apply the plan here (without DP, schedule its step: its admissions go in the plan), send it to every
        rank and run it here. -> every DP group's outputs and metrics; finished
        requests are no longer live."""
        apply_requests(self.engine, plan)
        batch = None
        if plan.command == "step" and self.state.dp_size == 1:
            batch = self.engine.schedule()  # rank 0 decides; the plan tells the others
            plan.admissions = batch.admissions if batch is not None else []
        broadcast_object(plan, self.state.control_group)
        if plan.command == "step" and self.state.dp_size > 1:
            batch = schedule_in_group(self.engine)
        outputs, metrics = finish_step(self.engine, plan, batch)
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
