"""Everything about ranks: driving every rank's engine through the same steps, in the serving loop
(`spmoe serve`) and the batch job (`spmoe generate`, the demo, warming up).

Every rank of a TP group runs the same steps on the same requests; under DP every rank steps
together (the MoE dispatch spans all of them), a DP group with nothing to run taking an empty step.

Admissions, one channel: which waiting requests join a step, and how many of their prompt tokens
come from the prefix cache (or that they fork), is decided by each DP group's TP rank 0, its leader,
which sends its decisions to its TP peers over the group's gloo control group (`follow_leader`),
with or without DP; the peers follow them and never look a prompt up themselves
(`Scheduler.schedule(admissions)`), raising where their cache cannot. Only in a step where the group
has waiting requests is anything sent (the ranks of a group agree on that, having admitted the
same). Block ids need not travel: each rank's block tables address its own pool, and a rank finds
the blocks to reuse by the same chain hashes.

The serving loop: rank 0 decides everything else. Each iteration it plans a step (`StepPlan`: the
new requests, each given to the least loaded DP group, or with the prompt of another new one to that
one's, the aborts, and whether to step at all), sends the plan to every rank over the gloo control
group, and every rank applies it and runs the step; under DP > 1 TP rank 0 of each DP group sends
its outputs and metrics back to rank 0 (`ServingLoop.step`). The other ranks apply plans until the
shutdown (`worker_loop`).

Under DP with CUDA graphs every rank replays the same graph each step (the expert dispatch spans
them all): before any replay the ranks agree on its kind, size and whether the drafter's graph
follows, by one all-reduce of five ints over the gloo control group (`agree_step`).

Both are an engine's channel to the other ranks (`channel()`), which `build_engine` hands it when it
builds it.

The batch job knows its requests up front, so it needs no plan per step: each DP group adds its own
share, and every rank steps until no rank has work left (`run_to_completion`; with DP > 1 one tiny
all-reduce per step says whether any rank still has).
"""

import time
from dataclasses import dataclass, field

import torch

from spmoe.distributed import get_parallel_state
from spmoe.distributed.comm import all_reduce, broadcast_object, gather_object
from spmoe.engine.engine import Engine, RankChannel, agreed_alone, per_prompt, scheduled_alone
from spmoe.engine.request import EngineMetrics, Request, RequestOutput, SamplingParams
from spmoe.engine.runner.graphs import StepNeeds
from spmoe.engine.scheduler import Scheduler
from spmoe.engine.sequence import Batch


def follow_leader(scheduler: Scheduler) -> Batch | None:
    """A step's batch on one of a DP group's several TP ranks: its TP rank 0 decides the admissions
    and sends them to the group's other ranks, which follow them. With nothing waiting nothing is
    admitted, and nothing sent."""
    state = get_parallel_state()
    if not scheduler.waiting:
        return scheduler.schedule([])
    # the group's TP rank 0
    leader = state.dp_rank * state.tp_size
    if state.tp_rank == 0:
        batch = scheduler.schedule()
        admitted = batch.admissions if batch is not None else []
        broadcast_object(admitted, state.tp_control_group, src=leader)
        return batch
    return scheduler.schedule(broadcast_object(None, state.tp_control_group, src=leader))


def channel() -> RankChannel:
    """This rank's channel to the others, for the engine built on it: on several TP ranks it follows
    its group leader's admissions (`follow_leader`); under DP its steps' CUDA graphs are agreed by
    every rank (`agree_step`)."""
    state = get_parallel_state()
    return RankChannel(
        schedule=follow_leader if state.tp_size > 1 else scheduled_alone,
        agree=agree_step if state.dp_size > 1 else agreed_alone,
    )


def agree_step(needs: StepNeeds) -> StepNeeds:
    """This rank's step needs -> every rank's (the most sequences and tokens of any rank; a graph
    kind only where every rank can run it): one all-reduce of five ints over the gloo control group,
    on the host, before any replay."""
    state = get_parallel_state()
    cannot = [not needs.decode, not needs.mixed, not needs.draft]
    ints = torch.tensor([needs.sequences, needs.tokens, *cannot], dtype=torch.int64)
    sequences, tokens, *cannot = all_reduce(ints, state.control_group, op="max").tolist()
    no_decode, no_mixed, no_draft = cannot
    return StepNeeds(
        sequences=sequences,
        tokens=tokens,
        decode=not no_decode,
        mixed=not no_mixed,
        draft=not no_draft,
    )


@dataclass
class StepPlan:
    """One iteration of the serving loop, the same on every rank."""

    command: str  # "step" (run one engine step), "idle" (the heartbeat: nothing to run), "shutdown"
    new: list[tuple[Request, int]] = field(default_factory=list)  # requests, the DP group of each
    aborts: list[str] = field(default_factory=list)  # request ids


@dataclass
class StepDone:
    """What a step of the serving loop gave, every DP group's: the outputs, the requests the engines
    refused (request id, why: it can never run there, or its id is in use), the metrics combined."""

    outputs: list[RequestOutput]
    refused: list[tuple[str, str]]
    metrics: EngineMetrics


def apply_requests(engine: Engine, plan: StepPlan) -> list[tuple[str, str]]:
    """This rank's DP group's new requests and the aborts of the plan, into its engine. -> the
    requests it refused (request id, why), the same on every rank of the group."""
    state, refused = get_parallel_state(), []
    for request, dp_group in plan.new:
        if dp_group == state.dp_rank:
            try:
                engine.add_request(request)
            except ValueError as e:
                refused.append((request.request_id, str(e)))
    for request_id in plan.aborts:
        engine.abort(request_id)
    return refused


def run_plan(engine: Engine, plan: StepPlan) -> StepDone | None:
    """Apply the plan and run its step on this rank. -> on rank 0, what every DP group's step gave;
    None on the other ranks."""
    state = get_parallel_state()
    refused = apply_requests(engine, plan)
    outputs = engine.step() if plan.command == "step" else []
    if state.dp_size == 1:
        return StepDone(outputs, refused, engine.metrics()) if state.rank == 0 else None
    mine = StepDone(outputs, refused, engine.metrics()) if state.tp_rank == 0 else None
    parts = gather_object(mine, state.control_group)
    if state.rank != 0:
        return None
    # TP rank 0 of each DP group
    per_dp = parts[:: state.tp_size]
    return StepDone(
        outputs=[out for part in per_dp for out in part.outputs],
        refused=[why for part in per_dp for why in part.refused],
        metrics=EngineMetrics.combine([part.metrics for part in per_dp]),
    )


def worker_loop(engine: Engine) -> None:
    """Every rank but 0: apply rank 0's plans until the shutdown."""
    state = get_parallel_state()
    while True:
        plan = broadcast_object(None, state.control_group)
        run_plan(engine, plan)
        if plan.command == "shutdown":
            return


class ServingLoop:
    """Rank 0's side of the serving loop: it plans each step and runs it on every rank."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.state = get_parallel_state()
        self.dp_of: dict[str, int] = {}  # live request -> its DP group

    def has_live(self) -> bool:
        return bool(self.dp_of)

    def plan(self, new: list[Request], aborts: list[str], shutdown: bool = False) -> StepPlan:
        """The next step: each new request goes to the least loaded DP group, but one whose prompt
        equals an earlier new request's goes to that one's group (the n choices of a request fork
        there, sharing the prompt's blocks); an abort of a request that is not live is dropped; the
        command is "step" while any request is live."""
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

    def step(self, plan: StepPlan) -> StepDone:
        """Send the plan to every rank and run it here. -> what every DP group's step gave; finished
        and refused requests are no longer live."""
        broadcast_object(plan, self.state.control_group)
        done = run_plan(self.engine, plan)
        for out in done.outputs:
            if out.finish_reason is not None:
                self.dp_of.pop(out.request_id, None)
        for request_id, _ in done.refused:
            self.dp_of.pop(request_id, None)
        return done


@dataclass
class Generation:
    outputs: list[list[int]]
    stats: dict
    logits: list[torch.Tensor] | None  # per sequence `[len(output), V]` float32, when recorded


def generate(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
    eos_token_ids: tuple[int, ...] = (),
    record_logits: bool = False,
    on_step=None,
) -> Generation:
    """The batch job on every rank: up to `max_new_tokens` after each prompt, stopping at any of
    `eos_token_ids`. `sampling`: one per prompt, or one for all, prompt i then sampling from seed
    `sampling.seed + i`. `on_step(done_tokens, live_sequences, prompt_tokens_cached)` is called
    after every step (for progress output). A request that ends with an error (non-finite logits)
    stops the job: FloatingPointError with its message."""
    samplings = sampling if isinstance(sampling, list) else per_prompt(sampling, len(prompts))
    engine.reset_stats()
    seqs = [
        engine.add_request(
            Request(f"generate-{i}", list(p), max_new_tokens, params, tuple(eos_token_ids)),
            record_logits,
        )
        for i, (p, params) in enumerate(zip(prompts, samplings))
    ]
    start = time.perf_counter()

    def progress() -> None:
        on_step(
            sum(len(s.output) for s in seqs),
            len(engine.scheduler.running),
            sum(min(s.cached, len(s.request.prompt)) for s in seqs),
        )

    run_to_completion(engine, progress if on_step is not None else None)
    return Generation(
        [s.output for s in seqs],
        engine.report(seqs, time.perf_counter() - start),
        [torch.stack(s.logits) for s in seqs] if record_logits else None,
    )


def run_to_completion(engine: Engine, on_step=None) -> None:
    """Step every rank until no rank has work left, after each step calling `on_step()`. A request
    that ends with an error (non-finite logits) stops the job: FloatingPointError with its
    message."""
    while _any_rank_busy(engine.has_unfinished()):
        failed = [out.error for out in engine.step() if out.finish_reason == "error"]
        if failed:
            raise FloatingPointError(failed[0])
        if on_step is not None:
            on_step()


def _any_rank_busy(busy: bool) -> bool:
    """With DP > 1 every rank runs every step (the MoE dispatch spans all of them), so a DP rank
    that is done keeps stepping with an empty batch until every rank is done: one tiny all-reduce
    per step."""
    state = get_parallel_state()
    if state.dp_size == 1:
        return busy
    flag = torch.tensor([int(busy)], device=state.device)
    return bool(all_reduce(flag, state.ep_group, op="max").item())
