"""Which sequences run each step, and how many tokens each feeds: a waiting queue, a running batch,
admission while the KV cache has room, chunked prefill under a token budget, and preemption when the
cache runs out.

A request becomes a `Sequence` when it is added and waits in arrival order. Each step (`schedule`):
1. every running sequence that decodes feeds its pending tokens (its last token and any drafts);
2. the token budget left (`max_num_batched_tokens` minus those) goes to prompts in chunks: first the
   running sequences still prefilling, in admission order, then waiting sequences, admitted first
   come first served while the cache has room for their first chunk and fewer than `max_num_seqs`
   run. A prompt may thus span several steps; it samples only after its last chunk.
3. each sequence that feeds this step first grows its cache room to hold what it feeds plus
   `reserve_tokens` (the MTP drafts written after it). If the cache cannot grow, the most recently
   admitted running sequence is preempted: its room is freed and it goes back to the front of the
   waiting queue, to be recomputed later from its prompt and the tokens it has generated so far.
A finished or aborted sequence leaves the batch and frees its room at once. A running sequence also
holds a row of the engine's `Sampler` (its sampling settings and output-token counts on the device):
taken at admission (a preempted sequence's output counted again), given back when it finishes
or is preempted.

Each sequence commits what the forward drew for it (`Sequence.commit`); then `update` does the
bookkeeping: a finished sequence leaves the batch and frees its room, one that goes on feeds its
last token and its next drafts, the rows written are cached (`cache_written`), and the committed
tokens are counted in the sampler's rows in one scatter per step.

Forks: prefill once, then fork (`BlockRoom` only, with prefix caching or without). A waiting
sequence whose prompt equals the one a running sequence is computing for the first time (the n
choices of a request) waits for it. In the step that completes that prompt, it joins the batch as a
fork (a part of role `Role.FORK`): it feeds nothing, draws its first token from the prompt's last
logits row with its own sampling row, seed and output index, and holds the source's full prompt
blocks (`BlockManager.fork`). A partly filled last block cannot be shared (each choice writes its
own tokens after the prompt), nor with MTP the block of the last prompt token (its MTP row embeds
the choice's first token): the fork recomputes those positions in its next step, fed with its first
token (at most a block's positions). From then on a fork is a sequence like any other (preempted,
aborted, finished alone).

The scheduler asks the cache about room in tokens, through a room (`rooms.py`).

Prefix caching (`BlockRoom` with `enable_prefix_caching`; see `cache/blocks.py`). A waiting sequence
is admitted with the longest chain of cached full blocks that matches what it feeds (its prompt, or
after a preemption its prompt and output): its `cached` count starts there and its prompt chunks
continue from it. A waiting sequence whose first block of prompt a running sequence is still
prefilling waits for it (prompts that begin alike: the shared blocks are computed and held once).
After each step `update` tells the room how many leading positions of each sequence have all their
rows written (`cache_written`), so that its full blocks become cached: with MTP a position's rows
are complete once the drafter has caught up on it, which it does in the step that verifies it,
except for a sequence that finishes there, or later when the lookup alone drafted that step
(`Sequence.written`). Preemption and finishing free a sequence's references; its cached blocks stay
for later requests until a new block needs their room. Every rank of a DP group runs this scheduler
on the same plans and the same sampled tokens, but only the group's TP rank 0 decides admissions
(which waiting sequences join, each with how many cached tokens, or as a fork: the batch's
`admissions`); the other ranks follow them (`schedule(admissions)`), never looking a prompt up
themselves, and raise if they cannot (`ranks.py` carries the decisions).
"""

import time
from collections import deque

from spmoe.engine.request import Request, RequestOutput
from spmoe.engine.rooms import BlockRoom, SlotRoom
from spmoe.engine.sampling.sampler import Sampler
from spmoe.engine.sequence import (
    Admission,
    Batch,
    Draft,
    Part,
    PartResult,
    Role,
    Sequence,
    Status,
)


class Scheduler:
    def __init__(
        self,
        room: SlotRoom | BlockRoom,
        sampler: Sampler,
        reserve_tokens: int = 0,
        max_num_batched_tokens: int = 8192,
        keep_in_step: bool = False,
    ):
        """`sampler`: where a running sequence holds its sampling row (`max_rows` >= the room's
        `max_num_seqs`); `reserve_tokens`: room a sequence needs beyond what it feeds (the drafts
        MTP writes after it); `max_num_batched_tokens`: the tokens one step feeds (decode tokens
        first, then prompt chunks); `keep_in_step`: schedule a step even with nothing to run (under
        DP every rank runs every step)."""
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.room, self.sampler = room, sampler
        self.reserve_tokens, self.max_num_batched_tokens = reserve_tokens, max_num_batched_tokens
        self.keep_in_step = keep_in_step
        if sampler.max_rows < room.max_num_seqs:
            raise ValueError(
                f"the sampler has {sampler.max_rows} rows for up to {room.max_num_seqs} running "
                "sequences"
            )
        self.waiting: deque[Sequence] = deque()
        # in admission order
        self.running: list[Sequence] = []
        # every sequence waiting or running, by request id
        self.requests: dict[str, Sequence] = {}
        self.preemptions = 0
        self.steps = 0  # steps scheduled since the engine's statistics were reset

    def tokens_needed(self, request: Request) -> int:
        """The most cache positions the request can occupy."""
        return len(request.prompt) + request.max_new_tokens + self.reserve_tokens

    def add(self, seq: Sequence) -> None:
        """Queue `seq` last; ValueError if its request id is already waiting or running."""
        if seq.request_id in self.requests:
            raise ValueError(
                f"request id {seq.request_id!r} is already in the engine; expected a new id"
            )
        self.requests[seq.request_id] = seq
        seq.pending, seq.prefilling, seq.status = list(seq.request.prompt), True, Status.WAITING
        self.waiting.append(seq)

    def schedule(self, admissions: list[Admission] | None = None) -> Batch | None:
        """-> the step's parts: the running sequences that feed, in admission order, each with the
        tokens it feeds from the head of its `pending` (it draws iff it feeds all of them), then the
        forks. None: nothing to run (unless `keep_in_step`: then an empty batch).

        `admissions`: None: this scheduler decides which waiting sequences join and what they reuse
        from the prefix cache (the batch's `admissions` say so). Else the deciding rank's decisions,
        in order, which this scheduler follows: it admits exactly those, and raises RuntimeError
        where it cannot (the ranks diverged)."""
        budget = self.max_num_batched_tokens - sum(
            len(s.pending) for s in self.running if not s.prefilling
        )
        work = []
        for seq in list(self.running):
            # preempted for an earlier sequence (a list lookup would cost O(n))
            if seq.cache_id < 0:
                continue
            count = len(seq.pending) if not seq.prefilling else min(len(seq.pending), budget)
            if count == 0:
                continue
            if self._make_room(seq, self._room_for(seq, seq.cached + count)):
                work.append(self._part(seq, count))
                budget -= count if seq.prefilling else 0
        forks = []
        if admissions is None:
            admissions = self._decide_admissions(budget, work, forks)
        else:
            self._follow_admissions(admissions, budget, work, forks)
        if not work and not self.keep_in_step:
            return None
        self.steps += 1
        return Batch(parts=work + forks, step=self.steps, admissions=admissions)

    def _part(self, seq: Sequence, count: int) -> Part:
        """`seq`'s part of this step: the first `count` tokens of its `pending`."""
        role = Role.DECODE
        if seq.prefilling:
            role = Role.PROMPT_END if count == len(seq.pending) else Role.PROMPT_CHUNK
        return Part(
            seq=seq,
            role=role,
            tokens=seq.pending[:count],
            start=seq.cached,
            location=self.room.location(seq),
            drafts=seq.drafts,
            lookup_drafts=seq.lookup_drafts,
        )

    def _decide_admissions(self, budget: int, work: list[Part], forks: list[Part]) -> list:
        """Admit waiting sequences, first come first served, while the budget, `max_num_seqs` and
        the cache allow, each with its longest cached prefix (its first chunk joins `work`), or
        forked from the sequence whose prompt it shares, in the step that completes that prompt (it
        joins `forks`).
        -> the admissions, in order."""
        admitted = []
        while self.waiting and len(self.running) < self.room.max_num_seqs:
            seq = self.waiting[0]
            source = self._fork_source(seq)
            # it waits for the source's prompt, and forks in the step ending it
            if source is not None:
                part = self._completing(source, work)
                if part is None or not self.room.can_fork(seq):
                    break
                forks.append(self._fork(seq, part))
                admitted.append(Admission(request_id=seq.request_id, fork=True))
                continue
            if budget <= 0:
                break
            cached = self.room.cached_prefix(seq)
            if self._twin_prefilling(seq, cached):
                break
            count = min(len(seq.pending) - cached, budget)
            if not self.room.can_allocate(self._room_for(seq, cached + count), seq):
                break
            budget -= self._admit(seq, count, cached, None, work)
            admitted.append(Admission(request_id=seq.request_id, cached=cached))
        return admitted

    def _follow_admissions(
        self, admissions: list[Admission], budget: int, work: list[Part], forks: list[Part]
    ) -> None:
        """Admit what the deciding rank admitted, each with its cached tokens or forked, as
        `_decide_admissions` (RuntimeError where this rank's state cannot: the ranks diverged)."""
        for admission in admissions:
            seq = self.waiting[0] if self.waiting else None
            full = len(self.running) >= self.room.max_num_seqs
            full = full or (not admission.fork and budget <= 0)
            source = self._fork_source(seq) if seq is not None and admission.fork else None
            part = self._completing(source, work) if source is not None else None
            if (
                seq is None
                or seq.request_id != admission.request_id
                or full
                or (admission.fork and part is None)
            ):
                how = "as a fork" if admission.fork else f"with {admission.cached} cached tokens"
                raise RuntimeError(
                    f"the deciding rank admits request {admission.request_id!r} {how}, but this "
                    f"rank's next waiting request is {seq and seq.request_id!r}, with {budget} "
                    f"tokens of budget and {len(self.running)} of {self.room.max_num_seqs} "
                    "sequences running: the ranks diverged"
                )
            if admission.fork:
                forks.append(self._fork(seq, part))
            else:
                count = min(len(seq.pending) - admission.cached, budget)
                budget -= self._admit(seq, count, admission.cached, admission.cached, work)

    @staticmethod
    def _completing(source: Sequence, work: list[Part]) -> Part | None:
        """`source`'s part if it feeds the rest of its prompt this step, else None."""
        return next((p for p in work if p.seq is source and p.role is Role.PROMPT_END), None)

    def _admit(
        self, seq: Sequence, count: int, cached: int, reuse: int | None, work: list[Part]
    ) -> int:
        """Move the first waiting sequence `seq` to the running batch with room for its `cached`
        tokens and a first chunk of `count` (`reuse`: the cached tokens as the deciding rank found
        them, None: look them up); its part joins `work`. -> `count`."""
        self.waiting.popleft()
        seq.cached = self.room.allocate(seq, self._room_for(seq, cached + count), reuse)
        seq.pending = seq.pending[seq.cached :]
        self._start(seq)
        work.append(self._part(seq, count))
        return count

    def _fork(self, seq: Sequence, source: Part) -> Part:
        """Move the first waiting sequence `seq` to the running batch as a fork of `source`'s
        sequence: it holds the full blocks of their prompt. -> its part."""
        self.waiting.popleft()
        seq.cached = self.room.fork(source.seq, seq)
        self._start(seq)
        return Part(
            seq=seq,
            role=Role.FORK,
            start=seq.cached,
            location=self.room.location(seq),
            source=source,
        )

    def _start(self, seq: Sequence) -> None:
        """An admitted sequence runs, holding its sampler row (a preempted one's output counted
        again); the first time, it notes when (`Sequence.scheduled_s`)."""
        request = seq.request
        if seq.scheduled_s is None:
            seq.scheduled_s = time.perf_counter()
        seq.sample_row = self.sampler.add(
            request.sampling, request.prompt, request.eos_token_ids, seq.output
        )
        seq.status = Status.RUNNING
        self.running.append(seq)

    def update(
        self, results: list[PartResult], drafts: dict[Sequence, Draft]
    ) -> list[RequestOutput]:
        """The bookkeeping after every part's commit (`Sequence.commit`): a finished sequence leaves
        and frees its room, one that goes on feeds its `drafts` after its last token, the rows
        written are cached. -> the commits' outputs (none for a prompt chunk)."""
        outputs, counted_rows, counted_tokens = [], [], []
        for result in results:
            part, seq, output = result.part, result.part.seq, result.output
            if seq.status is Status.RUNNING:
                draft = drafts.get(seq, Draft(tokens=[]))
                seq.drafts, seq.lookup_drafts = draft.tokens, draft.from_lookup
                seq.pending += seq.drafts
                self.room.cache_written(seq, seq.written)
                if output is not None:
                    counted_rows += [seq.sample_row] * len(output.new_token_ids)
                    counted_tokens += output.new_token_ids
            else:
                if output.new_token_ids:
                    # the MTP drafter does not catch up on a finishing sequence: its last positions
                    # lack their row
                    self.room.cache_written(seq, part.start if self.reserve_tokens else seq.cached)
                self._leave(seq)
                del self.requests[seq.request_id]
            if output is not None:
                outputs.append(output)
        self.sampler.commit(counted_rows, counted_tokens)
        return outputs

    def _fork_source(self, seq: Sequence) -> Sequence | None:
        """The running sequence that waiting `seq` forks from: the first one computing the same
        prompt for the first time (the n choices of a request, the same prompt sent twice). `seq`
        waits for it to complete the prompt, then takes its first token from that prompt's last
        logits row and shares its full blocks. None: `seq` computes its own prompt (no such
        sequence, no blocks to share, it resumes after a preemption with tokens of its own, or it
        wants its prompt's logprobs, which come from its own forward)."""
        if not self.room.forks or seq.output or seq.wants_prompt_logprobs:
            return None
        prompt = seq.request.prompt
        return next(
            (
                s
                for s in self.running
                if s.prefilling and not s.output and s.request.prompt == prompt
            ),
            None,
        )

    def _twin_prefilling(self, seq: Sequence, cached: int) -> bool:
        """Whether a running sequence still prefilling will write more full blocks that waiting
        `seq` begins with than the `cached` tokens it finds now (prompts that begin alike: a system
        prompt, a conversation that goes on; an equal prompt forks instead: `_fork_source`).
        It then waits (and those behind it) until those blocks are written, to share them from the
        prefix cache instead of computing and holding its own copy. Not with caching off, nor for a
        sequence that wants its prompt's logprobs."""
        size = self.room.shared_block
        if size is None or len(seq.pending) <= size or seq.wants_prompt_logprobs:
            return False
        for twin in self.running:
            if not twin.prefilling or twin.request.prompt[:size] != seq.pending[:size]:
                continue
            common = next(
                (i for i, (a, b) in enumerate(zip(twin.request.prompt, seq.pending)) if a != b),
                min(len(twin.request.prompt), len(seq.pending)),
            )
            # its last token is always computed
            if min(common, len(seq.pending) - 1) // size * size > cached:
                return True
        return False

    def _room_for(self, seq: Sequence, fed: int) -> int:
        """The room `seq` needs once it holds `fed` tokens: those and the reserve, but never more
        than its request can occupy (the drafts' rows past that are never written: it
        finishes first)."""
        return min(fed + self.reserve_tokens, self.tokens_needed(seq.request))

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq` to `num_tokens` tokens, preempting the latest admitted sequences (maybe `seq`
        itself) until it fits. -> whether `seq` still runs."""
        while not self.room.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.room.grow(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's room and queue it first, to recompute its prompt and
        output later."""
        self._leave(seq)
        seq.cached, seq.drafts, seq.lookup_drafts = 0, [], 0
        seq.prefilling, seq.status = True, Status.WAITING
        if not seq.prompt_logprobs_sent:
            seq.prompt_logprobs = []  # gathered again as the prompt is recomputed
        seq.pending = list(seq.request.prompt) + seq.output
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _leave(self, seq: Sequence) -> None:
        """Out of the running batch: its cache room, its sampler row and the MTP rows owed to it
        freed (a preempted sequence's are computed again with its prompt)."""
        self.running.remove(seq)
        self.room.free(seq)
        seq.owed = None
        self.sampler.release(seq.sample_row)
        seq.sample_row = -1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a running sequence out of the batch with finish reason `reason` and
        free its room."""
        seq.status = Status(reason)
        self._leave(seq)
        del self.requests[seq.request_id]

    def abort(self, request_id: str) -> bool:
        """Drop the sequence wherever it is, freeing its room. -> whether it was there."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            del self.requests[request_id]
            seq.status = Status.ABORTED
        else:
            self.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
