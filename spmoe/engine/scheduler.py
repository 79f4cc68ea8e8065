"""Which sequences run each step, and how many tokens each feeds: a waiting queue, a running batch, admission
while the KV cache has room, chunked prefill under a token budget, and preemption when the cache runs out.

A request becomes a `Sequence` when it is added and waits in arrival order. Each step (`schedule`):
1. every running sequence that decodes feeds its pending tokens (its last token and any drafts);
2. the token budget left (`max_num_batched_tokens` minus those) goes to prompts in chunks: first the running
   sequences still prefilling, in admission order, then waiting sequences, admitted first come first served
   while the cache has room for their first chunk and fewer than `max_num_seqs` run. A prompt may thus span
   several steps; it samples only after its last chunk.
3. each sequence that feeds this step first grows its cache room to hold what it feeds plus `reserve_tokens`
   (the MTP drafts written after it). If the cache cannot grow, the most recently admitted running sequence
   is preempted: its room is freed and it goes back to the front of the waiting queue, to be recomputed
   later from its prompt and the tokens it has generated so far.
A finished or aborted sequence leaves the batch and frees its room at once. A running sequence also holds a
row of the engine's `Sampler` (its sampling settings and output-token counts on the device): taken at
admission (a preempted sequence's output counted again), given back when it finishes or is preempted.

After the forward, `update` commits what the model runner chose (`StepResult`): a prompt chunk advances the
cached count; a sequence that sampled appends its tokens, keeps the cache rows of its verified positions and
feeds its last token and its next drafts, and walks its grammar (structured output) on; it finishes at an eos id
or once its grammar is complete ("stop"), at its token limit ("length"), or with no token when its logits were
not finite ("error"), freeing its room. The committed tokens are counted in the sampler's rows in one scatter
per step; prompt logprobs gather chunk by chunk and go out with the sequence's first tokens.

Forks: prefill once, then fork (`BlockRoom` only, with prefix caching or without). A waiting sequence whose
prompt equals the one a running sequence is computing for the first time (the n choices of a request) waits
for it. In the step that completes that prompt, it joins the batch as a fork (`ScheduledBatch.forks`): it
feeds nothing, draws its first token from the prompt's last logits row with its own sampling row, seed and
output index, and holds the source's full prompt blocks (`BlockManager.fork`). A partly filled last block
cannot be shared (each choice writes its own tokens after the prompt), nor with MTP the block of the last
prompt token (its MTP row embeds the choice's first token): the fork recomputes those positions in its next
step, fed with its first token (at most a block's positions). From then on a fork is a sequence like any
other (preempted, aborted, finished alone).

The scheduler asks the cache about room in tokens, through a room's small interface (`fits`, `cached_prefix`,
`can_allocate`, `allocate`, `can_grow`, `grow`, `forks`, `can_fork`, `fork`, `cache_written`, `free`,
`location`, `usage`, `prefix_cache_counts`): `SlotRoom` over the slot `KVCache` (the dense reference),
`BlockRoom` over the paged cache's blocks.

Prefix caching (`BlockRoom` with `enable_prefix_caching`; see `block_manager.py`). A waiting sequence is
admitted with the longest chain of cached full blocks that matches what it feeds (its prompt, or after a
preemption its prompt and output): its `cached` count starts there and its prompt chunks continue from it.
A waiting sequence whose first block of prompt a running sequence is still prefilling waits for it (prompts
that begin alike: the shared blocks are computed and held once).
After each step `update` tells the room how many leading positions of each sequence have all their rows
written (`cache_written`), so that its full blocks become cached: with MTP a position's rows are complete once
the drafter has caught up on it, which it does in the step that verifies it, except for a sequence that
finishes there. Preemption and finishing free a sequence's references; its cached blocks stay for later
requests until a new block needs their room. Every rank of a DP group runs this scheduler on the same plans and
the same sampled tokens, but only the group's TP rank 0 decides admissions (which waiting sequences join, each
with how many cached tokens: the batch's `admissions`); the other ranks follow them (`schedule(admissions)`),
never looking a prompt up themselves, and raise if they cannot (`serving_loop.py` carries the decisions).
"""

from collections import deque

from spmoe.engine.cache.blocks import BlockManager
from spmoe.engine.cache.paged import PagedKVCache
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.request import Request, RequestOutput
from spmoe.engine.sampling.sampler import Sampler
from spmoe.engine.sequence import ScheduledBatch, Sequence, StepResult

FORKED = -1  # an admission's reuse for a sequence that joins as a fork (`ScheduledBatch.forks`)


class SlotRoom:
    """The slot KV cache as room for tokens: a sequence gets one slot of `max_len` positions for its life."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.max_num_seqs = cache.max_seqs

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens can ever be held (the cache empty)."""
        return num_tokens <= self.cache.max_len

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.cache.max_len

    def cached_prefix(self, seq: Sequence) -> int:
        """The slot cache keeps nothing past a sequence's life: no token is ever cached for a new one."""
        return 0

    @property
    def shared_block(self) -> int | None:
        """No prefix cache: nothing is shared."""
        return None

    forks = False  # a slot holds one sequence's rows: the n choices of a request compute their prompts each

    def can_allocate(self, num_tokens: int, seq: Sequence) -> bool:
        """Whether a new sequence of up to `num_tokens` tokens can get room now."""
        return self.cache.free_slots > 0 and self.fits(num_tokens)

    def allocate(self, seq: Sequence, num_tokens: int, reuse: int | None = None) -> int:
        """A slot for `seq` (`reuse`: what the deciding rank found cached, 0 here). -> 0: nothing of it is
        cached."""
        if reuse:
            raise ValueError(
                f"the slot cache keeps no prefix; the deciding rank reuses {reuse} tokens"
            )
        seq.cache_id = self.cache.allocate()
        return 0

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens in all (a slot holds `max_len` from the start)."""
        return self.fits(num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def cache_written(self, seq: Sequence, num_written: int) -> None:
        """Nothing to keep: a slot is released whole."""

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found): none without one."""
        return 0, 0

    def free(self, seq: Sequence) -> None:
        self.cache.release(seq.cache_id)
        seq.cache_id = -1

    def location(self, seq: Sequence) -> int:
        """What the cache's `view` takes for `seq`: its slot."""
        return seq.cache_id

    def usage(self) -> float:
        """The share of the cache held by sequences (0..1)."""
        return 1 - self.cache.free_slots / self.cache.max_seqs

    def stats(self) -> dict:
        return {
            "kind": "slots",
            "bytes_per_token": self.cache.bytes_per_token,
            "slots": self.cache.max_seqs,
            "max_len": self.cache.max_len,
        }


class BlockRoom:
    """The paged KV cache's blocks as room for tokens: a sequence holds blocks for what it has fed (and its
    reserve), and grows them as it goes; up to `max_num_seqs` sequences at once, each of up to
    `max_model_len` tokens (None: the whole cache). `enable_prefix_caching`: full blocks stay cached for later
    sequences; `lookahead`: the tokens past a block that its rows depend on (1 when the engine drafts with MTP,
    whose row at a position embeds the next token)."""

    def __init__(
        self,
        cache: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        lookahead: int = 0,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.cache, self.max_num_seqs = cache, max_num_seqs
        self.blocks = BlockManager(
            cache.num_blocks, cache.block_size, enable_prefix_caching, lookahead
        )
        self.max_model_len = min(
            max_model_len or self.blocks.capacity_tokens, self.blocks.capacity_tokens
        )
        self.peak_blocks = 0  # the most blocks in use at once
        self._next_id = 0

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.max_model_len

    def cached_prefix(self, seq: Sequence) -> int:
        """Tokens at the head of what a waiting sequence feeds (`pending`) that cached blocks hold."""
        return self.blocks.cached_prefix(self._lookup(seq), seq.block_hashes)

    @property
    def shared_block(self) -> int | None:
        """The tokens of a block sequences can share through the prefix cache (None: caching off)."""
        return self.blocks.block_size if self.blocks.enable_caching else None

    def can_allocate(self, num_tokens: int, seq: Sequence) -> bool:
        """Whether waiting `seq` fits now with room for `num_tokens` tokens in all, its cached prefix included."""
        return self.blocks.can_allocate(num_tokens, self._lookup(seq), seq.block_hashes)

    forks = True  # sequences with the same prompt share its full blocks (`fork`), with prefix caching or not

    def can_fork(self, seq: Sequence) -> bool:
        """Whether waiting `seq` can fork from a sequence with its prompt now (the blocks it needs are free)."""
        return self.blocks.can_fork(len(seq.request.prompt))

    def fork(self, source: Sequence, seq: Sequence) -> int:
        """Room for waiting `seq`'s prompt, which running `source` has (or writes this step): it shares the
        source's full blocks (`BlockManager.fork`). -> the prompt tokens shared: it computes the rest."""
        seq.cache_id, self._next_id = self._next_id, self._next_id + 1
        shared = self.blocks.fork(source.cache_id, seq.cache_id, len(seq.request.prompt))
        self._note_peak()
        return shared

    @staticmethod
    def _lookup(seq: Sequence) -> list[int]:
        """What to look up in the prefix cache for `seq`: what it feeds, or nothing when it wants its prompt's
        logprobs (they come from the forward over the prompt: a cached block would skip them)."""
        return [] if seq.wants_prompt_logprobs else seq.pending

    def allocate(self, seq: Sequence, num_tokens: int, reuse: int | None = None) -> int:
        """Room for `num_tokens` tokens of a new sequence, its cached prefix included: the longest one cached,
        or the `reuse` tokens the deciding rank found (RuntimeError if this cache lacks them). -> the tokens of
        what it feeds (`pending`) already cached."""
        seq.cache_id, self._next_id = self._next_id, self._next_id + 1
        cached = self.blocks.allocate(
            seq.cache_id, num_tokens, self._lookup(seq), seq.block_hashes, reuse
        )
        self._note_peak()
        return cached

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks.can_grow(
            seq.cache_id, max(0, num_tokens - self.blocks.reserved(seq.cache_id))
        )

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Room for `num_tokens` tokens of `seq` in all."""
        self.blocks.grow(seq.cache_id, max(0, num_tokens - self.blocks.reserved(seq.cache_id)))
        self._note_peak()

    def cache_written(self, seq: Sequence, num_written: int) -> None:
        """`seq`'s first `num_written` positions hold all their rows: its full blocks among them become cached.
        The token list is built only when a block may be completed (once per block, not per step)."""
        known = len(seq.request.prompt) + len(seq.output)
        if self.blocks.would_cache(seq.cache_id, num_written, known):
            self.blocks.cache_blocks(seq.cache_id, seq.request.prompt + seq.output, num_written)

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found cached) since start."""
        return self.blocks.queries, self.blocks.hits

    def free(self, seq: Sequence) -> None:
        self.blocks.free(seq.cache_id)
        seq.cache_id = -1

    def location(self, seq: Sequence) -> list[int]:
        """What the cache's `view` takes for `seq`: its block table."""
        return self.blocks.block_table(seq.cache_id)

    def usage(self) -> float:
        """The share of the blocks held by sequences (0..1; cached blocks nobody holds are free)."""
        return self.blocks.usage

    def stats(self) -> dict:
        return {
            "kind": "paged",
            "kv_cache_dtype": "fp8" if self.cache.fp8 else "auto",
            "bytes_per_token": self.cache.bytes_per_token,
            "block_size": self.cache.block_size,
            "num_blocks": self.blocks.num_blocks,
            "capacity_tokens": self.blocks.capacity_tokens,
            "blocks_in_use": self.blocks.num_used_blocks,
            "peak_blocks_in_use": self.peak_blocks,
            "prefix_caching": self.blocks.enable_caching,
            "cached_blocks": self.blocks.num_cached_blocks,
            "prefix_cache_queries": self.blocks.queries,
            "prefix_cache_hits": self.blocks.hits,
        }

    def _note_peak(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self.blocks.num_used_blocks)


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
        `max_num_seqs`); `reserve_tokens`: room a sequence needs beyond what it feeds (the drafts MTP writes after it);
        `max_num_batched_tokens`: the tokens one step feeds (decode tokens first, then prompt chunks);
        `keep_in_step`: schedule a step even with nothing to run (under DP every rank runs every step)."""
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.room, self.reserve_tokens, self.max_num_batched_tokens = (
            room,
            reserve_tokens,
            max_num_batched_tokens,
        )
        self.keep_in_step, self.sampler = keep_in_step, sampler
        if sampler.max_rows < room.max_num_seqs:
            raise ValueError(
                f"the sampler has {sampler.max_rows} rows for up to {room.max_num_seqs} running sequences"
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.preemptions = 0
        self.steps = 0  # steps scheduled since the engine's statistics were reset

    def tokens_needed(self, request: Request) -> int:
        """The most cache positions the request can occupy."""
        return len(request.prompt) + request.max_new_tokens + self.reserve_tokens

    def holds(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in (*self.waiting, *self.running))

    def add(self, seq: Sequence) -> None:
        seq.pending, seq.prefilling = list(seq.request.prompt), True
        self.waiting.append(seq)

    def schedule(self, admissions: list[tuple[str, int]] | None = None) -> ScheduledBatch | None:
        """-> the sequences that run this step, in admission order, with the tokens each feeds from the head of
        its `pending`; a sequence samples this step iff it feeds all its pending tokens. None: nothing to run
        (unless `keep_in_step`: then an empty batch).

        `admissions`: None: this scheduler decides which waiting sequences join and how many of their tokens
        come from the prefix cache, and the batch's `admissions` say so. Else the deciding rank's decisions
        (request id, tokens it reuses or `FORKED`), in order, which this scheduler follows instead of deciding: it
        admits exactly those, each with those cached tokens or as a fork, and raises RuntimeError where it cannot
        (the ranks diverged)."""
        budget = self.max_num_batched_tokens - sum(
            len(s.pending) for s in self.running if not s.prefilling
        )
        work = []
        for seq in list(self.running):
            if (
                seq.cache_id < 0
            ):  # preempted for an earlier sequence: no room (a list lookup would cost O(n))
                continue
            count = len(seq.pending) if not seq.prefilling else min(len(seq.pending), budget)
            if count == 0:
                continue
            if self._make_room(seq, self._room_for(seq, seq.cached + count)):
                work.append((seq, count))
                budget -= count if seq.prefilling else 0
        if admissions is None:
            admitted, forks = self._decide_admissions(budget, work)
        else:
            admitted, forks = self._follow_admissions(admissions, budget, work)
        if not work and not self.keep_in_step:
            return None
        self.steps += 1
        return ScheduledBatch(
            [s for s, _ in work],
            [n for _, n in work],
            [s.cached for s, _ in work],
            [self.room.location(s) for s, _ in work],
            [n == len(s.pending) for s, n in work],
            all(not s.prefilling for s, _ in work),
            self.steps,
            admitted,
            forks,
        )

    def _decide_admissions(self, budget: int, work: list) -> tuple[list[tuple[str, int]], list]:
        """Admit waiting sequences, first come first served, while the budget, `max_num_seqs` and the cache
        allow, each with its longest cached prefix (it joins `work` with its first chunk), or forked from the
        sequence whose prompt it shares, in the step that completes that prompt (`_fork_source`). -> (request
        id, tokens reused or `FORKED`) of each, in order, and the forks (the fork, its source's index in
        `work`)."""
        admitted, forks = [], []
        while self.waiting and len(self.running) < self.room.max_num_seqs:
            seq = self.waiting[0]
            source = self._fork_source(seq)
            if (
                source is not None
            ):  # it waits for the source's prompt, and forks in the step that completes it
                index = self._completing(source, work)
                if index is None or not self.room.can_fork(seq):
                    break
                forks.append((self._fork(seq, source), index))
                admitted.append((seq.request_id, FORKED))
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
            admitted.append((seq.request_id, cached))
        return admitted, forks

    def _follow_admissions(
        self, admissions: list[tuple[str, int]], budget: int, work: list
    ) -> tuple[list, list]:
        """Admit what the deciding rank admitted (`admissions`: request id, tokens reused or `FORKED`), each
        with those cached tokens or forked (RuntimeError where this rank's state cannot: the ranks diverged).
        -> `admissions` and the forks, as `_decide_admissions`."""
        forks = []
        for request_id, reuse in admissions:
            seq = self.waiting[0] if self.waiting else None
            full = len(self.running) >= self.room.max_num_seqs or (reuse != FORKED and budget <= 0)
            source = self._fork_source(seq) if seq is not None and reuse == FORKED else None
            index = self._completing(source, work) if source is not None else None
            if (
                seq is None
                or seq.request_id != request_id
                or full
                or (reuse == FORKED and index is None)
            ):
                raise RuntimeError(
                    f"the deciding rank admits request {request_id!r} "
                    f"{'as a fork' if reuse == FORKED else f'with {reuse} cached tokens'}, but this rank's next "
                    f"waiting request is {seq and seq.request_id!r}, with {budget} tokens of budget and "
                    f"{len(self.running)} of {self.room.max_num_seqs} sequences running: the ranks diverged"
                )
            if reuse == FORKED:
                forks.append((self._fork(seq, source), index))
            else:
                budget -= self._admit(
                    seq, min(len(seq.pending) - reuse, budget), reuse, reuse, work
                )
        return admissions, forks

    @staticmethod
    def _completing(source: Sequence, work: list) -> int | None:
        """The index in `work` of `source` if it feeds the rest of its prompt this step, else None."""
        return next(
            (i for i, (s, n) in enumerate(work) if s is source and n == len(s.pending)), None
        )

    def _admit(self, seq: Sequence, count: int, cached: int, reuse: int | None, work: list) -> int:
        """Move the first waiting sequence `seq` to the running batch with room for its `cached` tokens and a
        first chunk of `count` (`reuse`: the cached tokens as the deciding rank found them, None: look them
        up); it joins `work`. -> `count`."""
        self.waiting.popleft()
        seq.cached = self.room.allocate(seq, self._room_for(seq, cached + count), reuse)
        seq.pending = seq.pending[seq.cached :]
        self._take_sampler_row(seq)
        self.running.append(seq)
        work.append((seq, count))
        return count

    def _fork(self, seq: Sequence, source: Sequence) -> Sequence:
        """Move the first waiting sequence `seq` to the running batch as a fork of `source`: it holds the full
        blocks of their prompt. -> `seq`."""
        self.waiting.popleft()
        seq.cached = self.room.fork(source, seq)
        self._take_sampler_row(seq)
        self.running.append(seq)
        return seq

    def _take_sampler_row(self, seq: Sequence) -> None:
        """An admitted sequence takes its sampler row (a preempted one's output counted again)."""
        request = seq.request
        seq.sample_row = self.sampler.add(
            request.sampling, request.prompt, request.eos_token_ids, seq.output
        )

    def update(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Commit a step's result. -> one output per sequence that sampled (a prompt chunk before the last
        commits nothing and has none)."""
        outputs, counted_rows, counted_tokens = [], [], []
        forks = [
            seq for seq, _ in batch.forks
        ]  # each fed nothing and drew its first token (after the others)
        for i, (seq, n, samples) in enumerate(
            zip(
                batch.seqs + forks,
                batch.num_tokens + [0] * len(forks),
                batch.samples + [True] * len(forks),
            )
        ):
            if (
                result.prompt_logprobs is not None
                and i < len(batch.seqs)
                and result.prompt_logprobs[i] is not None
            ):
                seq.prompt_logprobs += result.prompt_logprobs[i]
            if not samples:  # a prompt chunk
                seq.cached += n
                seq.pending = seq.pending[n:]
                self.room.cache_written(seq, seq.cached)
                continue
            if not result.finite[i]:
                seq.error = (
                    f"non-finite logits (NaN or inf) at step {batch.step} ({'decode' if seq.cached else 'prefill'}) "
                    f"for request {seq.request_id!r} after {len(seq.output)} generated tokens: no token can be "
                    f"chosen (check the checkpoint for NaN / inf weights)"
                )
                self.finish(seq, "error")
                outputs.append(self._output(seq, []))
                continue
            tokens, reason = seq.until_stop(result.token_ids[i])
            if seq.grammar is not None:
                tokens, reason = self._advance_grammar(seq, tokens, reason)
            seq.output += tokens
            if reason is None:  # a finished sequence's row is given back: nothing to count
                counted_rows += [seq.sample_row] * len(tokens)
                counted_tokens += tokens
            if seq.record_logits:
                seq.logits += result.logit_rows[i][: len(tokens)]
            verified = n - (
                len(seq.drafts) - result.accepted[i]
            )  # the fed positions whose rows stay valid
            if reason is not None:
                # the MTP drafter does not catch up on a finishing sequence: its last positions lack their row
                self.room.cache_written(seq, seq.cached + (0 if self.reserve_tokens else verified))
                self.finish(seq, reason)
            output = self._output(seq, tokens)
            if result.logprobs is not None and result.logprobs[i] is not None:
                output.logprobs = result.logprobs[i][: len(tokens)]
            if seq.wants_prompt_logprobs:
                output.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
            outputs.append(output)
            seq.cached += verified
            if reason is None:
                self.room.cache_written(seq, seq.cached)
            seq.drafts = (
                result.drafts[i]
                if result.drafts is not None and reason is None and i < len(batch.seqs)
                else []
            )
            # a fork feeds next the rest of its prompt that it does not share, then its first token
            seq.pending = seq.request.prompt[seq.cached :] + [tokens[-1]] + seq.drafts
            seq.prefilling = seq.cached < len(seq.request.prompt)
        self.sampler.commit(counted_rows, counted_tokens)
        return outputs

    @staticmethod
    def _advance_grammar(
        seq: Sequence, tokens: list[int], reason: str | None
    ) -> tuple[list[int], str | None]:
        """Walk `seq`'s grammar through the tokens it commits -> (those it keeps, its finish reason): "stop" once
        the grammar has taken its stop token (with `ignore_eos` that is no eos id), "error" for a token the
        grammar refuses (which its mask did not allow: it cannot happen)."""
        for j, token in enumerate(tokens):
            if not seq.grammar.accept(token):
                seq.error = f"request {seq.request_id!r}: token {token} does not follow its grammar"
                return tokens[: j + 1], "error"
            if seq.grammar.finished:
                return tokens[: j + 1], reason or "stop"
        return tokens, reason

    @staticmethod
    def _output(seq: Sequence, tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            seq.request_id, tokens, seq.finish_reason, seq.error, len(seq.request.prompt)
        )

    def _fork_source(self, seq: Sequence) -> Sequence | None:
        """The running sequence that waiting `seq` forks from: the first one computing the same prompt for the
        first time (the n choices of a request, the same prompt sent twice). `seq` waits for it to complete the
        prompt, then takes its first token from that prompt's last logits row and shares its full blocks. None:
        `seq` computes its own prompt (no such sequence, no blocks to share, it resumes after a preemption
        with tokens of its own, or it wants its prompt's logprobs, which come from its own forward)."""
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
        """Whether a running sequence still prefilling will write more full blocks that waiting `seq` begins
        with than the `cached` tokens it finds now (prompts that begin alike: a system prompt, a conversation
        that goes on; an equal prompt forks instead: `_fork_source`).
        It then waits (and those behind it) until those blocks are written, to share them from the prefix cache
        instead of computing and holding its own copy. Not with caching off, nor for a sequence that wants its
        prompt's logprobs."""
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
            if (
                min(common, len(seq.pending) - 1) // size * size > cached
            ):  # its last token is always computed
                return True
        return False

    def _room_for(self, seq: Sequence, fed: int) -> int:
        """The room `seq` needs once it holds `fed` tokens: those and the reserve, but never more than its
        request can occupy (the drafts' rows past that are never written: it finishes first)."""
        return min(fed + self.reserve_tokens, self.tokens_needed(seq.request))

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq` to `num_tokens` tokens, preempting the latest admitted sequences (maybe `seq` itself)
        until it fits. -> whether `seq` still runs."""
        while not self.room.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.room.grow(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's room and queue it first, to recompute its prompt and output later."""
        self._leave(seq)
        seq.cached, seq.drafts, seq.prefilling = 0, [], True
        if not seq.prompt_logprobs_sent:
            seq.prompt_logprobs = []  # gathered again as the prompt is recomputed
        seq.pending = list(seq.request.prompt) + seq.output
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a running sequence out of the batch and free its room."""
        seq.finish_reason = reason
        self._leave(seq)

    def _leave(self, seq: Sequence) -> None:
        """Out of the running batch: its cache room and its sampler row freed."""
        self.running.remove(seq)
        self.room.free(seq)
        self.sampler.release(seq.sample_row)
        seq.sample_row = -1

    def abort(self, request_id: str) -> bool:
        """Drop the sequence wherever it is, freeing its room. -> whether it was there."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return True
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
