"""CUDA graphs for the decode step (one new token per live sequence, or with MTP speculation its
token and its k drafts) and for any other step of up to 512 tokens (paged cache), SP on or off.

Launching a decode step's few hundred small kernels and collectives one by one costs more than
running them at small batches. Instead the step (the model, then the LM head) is captured once per
padded batch size B in `static_step.BATCH_SIZES` up to the engine's sequence count, and each decode
step replays the smallest graph that fits. Pad sequences get token 0 at positions 0 .. T - 1 in the
cache's scratch slot or block; they attend only themselves and their logits are dropped.

With speculation (k drafts) each sequence feeds T = 1 + k tokens at positions p .. p + k, laid out
in sequence order (row b * T + j), and a second graph per B holds the MTP drafter's step
(`draft_tokens`; `drafter.MtpDrafter` is its eager form): the catch-up over all B * T fed rows (a
row past a sequence's last verified position writes an MTP cache row that a later write replaces
before anything reads it, as the target's rejected rows do), then its k - 1 one-token steps, each
fed the slot's draft: the context lookup's where it leads the sequence's draft (an input, -1
elsewhere), else the MTP layer's own choice. The host's work between the two replays is the choice
of tokens (the sampler and the acceptance rule), which also says which row is each sequence's last
verified one, and the lookup. Speculation by the lookup alone has no drafter graph: its decode
graphs feed one token per sequence, and a step whose sequences have drafts (of varying counts)
replays a mixed graph.

Paged cache: any other step of N <= 512 fed tokens (a prompt chunk beside the decoding sequences,
the next turn of a conversation whose history is cached, a speculative step whose sequences feed
different counts) replays the mixed graph of the smallest captured size R >= N in
`static_step.MIXED_TOKENS`. Its rows are laid end to end as the eager step lays them (sequence i's
tokens at their positions, each row naming table row i), then R - N pad rows name the all-scratch
table row, at positions within the scratch block. The graph holds the model only: the model runner
computes the logits of the rows the step commits from after the replay, as it does after an eager
step (a `[rows, V]` float32 output per graph would hold gigabytes across the sizes). Each row reads
the cache by its own position and table, so it computes what the eager step computes. Longer steps
run eagerly, as every step but decode does on the slot cache (its graph rows each
read a whole slot).

Every graph is captured at start-up (largest first, the others share its memory pool), on every rank
in the same order, so nothing is captured while serving; `captures` counts them.

- Slot cache: a row reads its slot's `max_len` positions.
- Paged cache: the block tables are as wide as the longest sequence may need (`max_model_len`
  positions, at most the whole cache), padded with the scratch block, so one graph serves every
  context length. The kernels read each row's real position and table from device memory: the
  indexer loads and scores only the blocks up to the row's position (the rest of its row are -inf
  keys, written without a load), `cache_rows` and sparse MLA look up only the selected positions.
  Each step copies only the table columns its longest sequence uses; stale entries beyond a row's
  own length are never read (every kernel masks positions past the row's position), and a pad row's
  first entry is always the scratch block, where it writes. The tables have one more row than
  sequences, all scratch: the drafter's steps of a sequence that stops this step write there (its
  own table may hold no room past its last token).

Under DP every rank replays the same graph each step, since the expert dispatch spans them all:
before any replay the ranks agree on the step's kind (decode, mixed or eager), its size and whether
the drafter's graph follows (`StepNeeds`, combined by `ranks.agree_step`; `shape`). A rank whose
step is a decode step replays the mixed graph when another rank feeds a prompt chunk; a rank with
nothing to run replays the agreed graph with pad rows alone. The graph's rows are then the largest
DP batch, a number fixed at capture (`static_step.decode_hidden`).

Captured, the step must not sync the host nor change shape with the data. Hence it needs the
`allgather_reducescatter` dispatch (`all_to_all` reads its counts back), experts that never sync the
host (not the torch reference), and a CUDA device.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from spmoe.distributed import CommStats, count_collectives
from spmoe.engine.cache.paged import PagedKVCache, check_room
from spmoe.engine.cache.slots import KVCache
from spmoe.engine.runner.static_step import (
    decode_hidden,
    deployment_problems,
    draft_tokens,
    graph_sizes,
    mixed_rows,
    mixed_sizes,
    padded_tables,
    table_width,
)
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM


@dataclass(frozen=True, kw_only=True)
class StepNeeds:
    """What one rank's step needs of the graphs, or (combined over the DP ranks, `ranks.agree_step`)
    what every rank's step needs: the sequences that feed and their tokens (the most of any rank),
    whether a decode graph and a mixed graph can run it, and whether the drafter's graph can follow
    a decode replay (no sequence drafts under a grammar); each true only if true on every rank."""

    sequences: int
    tokens: int
    decode: bool
    mixed: bool
    draft: bool


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What every DP rank runs this step: the decode graph of `size` sequences, the mixed graph of
    `size` rows, or an eager step (`size`: the most tokens a rank feeds); `draft_graph`: the
    drafter's graph follows the decode replay."""

    kind: Literal["decode", "mixed", "eager"]
    size: int
    draft_graph: bool


@dataclass
class CapturedDraft:
    """The drafter's step of one batch size B (with k drafts, T = 1 + k fed tokens per sequence)."""

    graph: torch.cuda.CUDAGraph
    # [B * T + 3 * B + B * k] int64: the token after each fed row, then per sequence its last
    # verified row, where its one-token steps write (`StepGraphs.draft`) and their first position,
    # then its forced draft per slot (-1: none)
    inputs: torch.Tensor
    # [B, k] int64: the MTP layer's own choice per slot, rewritten by each replay
    drafts: torch.Tensor
    collectives: CommStats  # of one replay, counted at capture


@dataclass
class CapturedStep:
    """A decode step of B sequences feeding T tokens each (N = B * T rows), or a mixed step of N
    rows over up to B sequences."""

    # B, the sequences it runs (pads included), or a mixed step's table rows but the scratch one
    size: int
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [3, N] int64: token ids, where (slot cache: the row's slot; paged: its
    # sequence's row of block_tables), positions
    # [B + 1, W] int32 (paged cache: W = `StepGraphs.width`), else None
    block_tables: torch.Tensor | None
    # [N, V] float32, rewritten by each replay (a view of the buffer every decode graph writes;
    # mixed: None, computed after it)
    logits: torch.Tensor | None
    hidden: torch.Tensor  # [N, H] the post-norm hidden the logits come from (the drafter's input)
    collectives: CommStats  # of one replay, counted at capture
    draft: CapturedDraft | None  # with speculation (decode steps)


class StepGraphs:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        cache: KVCache | PagedKVCache,
        max_num_seqs: int,
        max_model_len: int | None = None,
        on_capture=None,
        drafts: int = 0,
        max_num_batched_tokens: int = 0,
    ):
        """Captures one graph per size in `graph_sizes(max_num_seqs)` now (with `drafts` > 0
        speculative steps: each sequence feeds 1 + drafts tokens, and a drafter's graph per size
        too), then, paged, a mixed step's per size in `mixed_sizes(max_num_batched_tokens)` (0:
        none), on every rank in the same order. Paged cache: block tables of
        `table_width(cache, max_model_len)` blocks (None: the whole cache).
        `on_capture(kind, size, index, count)` is called before each capture (progress output): kind
        "decode" (size: B) or "mixed" (size: tokens), the index-th of count."""
        problems = deployment_problems(cache.device.type, model.parallel.ep_backend)
        capturable, experts = model.graph_capturable
        if not capturable:
            problems.append(
                f"experts that never sync the host (got moe backend {experts!r}; bfloat16 on a "
                "GPU picks triton)"
            )
        if problems:
            raise ValueError("CUDA graphs for decode need " + "; ".join(problems))
        self.model, self.cache, self.max_num_seqs, self.drafts = model, cache, max_num_seqs, drafts
        self.tokens_per_seq = 1 + drafts
        self.paged = isinstance(cache, PagedKVCache)
        self.width = table_width(cache, max_model_len or cache.capacity_tokens) if self.paged else 0
        self.steps: dict[int, CapturedStep] = {}  # B -> graph
        self.mixed: dict[int, CapturedStep] = {}  # padded tokens -> graph
        self.captures = 0  # graphs captured by this object, ever
        # the step replayed last, whose rows `draft` continues
        self.replayed: CapturedStep | None = None
        self._pool = None
        # every decode graph's logits, [largest B * T, V] float32, allocated once: one graph
        # replays at a time, and a buffer per size would hold B * T * V * 4 bytes for each of
        # ~20 sizes (3.5 GiB at GLM-5.2's vocabulary, 256 sequences and 3 drafts)
        self._logits: torch.Tensor | None = None
        # largest first: the others
        plan = [("decode", size) for size in reversed(graph_sizes(max_num_seqs))]
        if self.paged and max_num_batched_tokens:  # reuse its memory
            plan += [("mixed", tokens) for tokens in reversed(mixed_sizes(max_num_batched_tokens))]
        for index, (kind, size) in enumerate(plan, 1):
            if on_capture is not None:
                on_capture(kind, size, index, len(plan))
            if kind == "decode":
                self._capture(size)
            else:
                self._capture_mixed(size)

    def batch_sizes(self) -> list[int]:
        """The padded batch sizes captured."""
        return sorted(self.steps)

    def fits(self, num_tokens: list[int]) -> bool:
        """Whether a decode step whose sequences feed `num_tokens` each can replay a graph."""
        return 0 < len(num_tokens) <= self.max_num_seqs and all(
            n == self.tokens_per_seq for n in num_tokens
        )

    def fits_mixed(self, num_tokens: list[int]) -> bool:
        """Whether a step whose sequences feed `num_tokens` each can replay a mixed graph: at most
        the largest size's tokens over at most `max_num_seqs` sequences."""
        return 0 < len(num_tokens) <= self.max_num_seqs and 0 < sum(num_tokens) <= max(
            self.mixed, default=0
        )

    def needs(self, num_tokens: list[int], decode: bool, grammars: bool) -> StepNeeds:
        """What a step of sequences feeding `num_tokens` each needs (`decode`: all of them decode;
        `grammars`: one of them drafts under a grammar). No sequences: any graph can run it."""
        return StepNeeds(
            sequences=len(num_tokens),
            tokens=sum(num_tokens),
            decode=not num_tokens or (decode and self.fits(num_tokens)),
            mixed=self.fits_mixed(num_tokens) if num_tokens else bool(self.mixed),
            draft=not grammars,
        )

    def shape(self, needs: StepNeeds) -> StepShape:
        """Every DP rank's step, from the needs of all (`ranks.agree_step`): the decode graph that
        fits the most sequences, else the mixed graph that fits the most tokens, else eager."""
        if needs.decode and needs.sequences:
            size = min(s for s in self.steps if s >= needs.sequences)
            return StepShape(kind="decode", size=size, draft_graph=needs.draft and self.drafts > 0)
        if needs.mixed and needs.tokens:
            size = min(n for n in self.mixed if n >= needs.tokens)
            return StepShape(kind="mixed", size=size, draft_graph=False)
        return StepShape(kind="eager", size=needs.tokens, draft_graph=False)

    def _capture(self, size: int) -> None:
        device, per_seq, k = self.cache.device, self.tokens_per_seq, self.drafts
        inputs = torch.zeros(3, size * per_seq, dtype=torch.long, device=device)
        # pad sequences: positions 0 .. T - 1
        inputs[2] = torch.arange(per_seq, device=device).repeat(size)
        tables = None
        if self.paged:
            inputs[1] = torch.arange(size, device=device).repeat_interleave(per_seq)
            tables = torch.full(
                (size + 1, self.width), self.cache.scratch_block, dtype=torch.int32, device=device
            )
        else:
            inputs[1] = self.cache.scratch_slot
        draft_inputs = torch.zeros(
            size * per_seq + 3 * size + size * k, dtype=torch.long, device=device
        )
        if k:
            self._pad_draft_inputs(draft_inputs, size, 0)

        if self._logits is None:  # the largest size is captured first
            vocab = self.model.cfg.vocab_size
            self._logits = torch.empty(size * per_seq, vocab, dtype=torch.float32, device=device)
        logits = self._logits[: size * per_seq]

        def target():
            hidden = decode_hidden(self.model, self.cache, inputs, tables)
            return self.model.compute_logits(hidden, out=logits), hidden

        def drafter(hidden):
            *split, forced = self._split(draft_inputs, size)
            return draft_tokens(
                self.model, self.cache, inputs, tables, hidden, *split, forced.view(size, k)
            )

        self._warm(lambda: drafter(target()[1]) if k else target())
        graph, (logits, hidden), collectives = self._record(target)
        draft = None
        if k:
            draft_graph, drafts, draft_collectives = self._record(lambda: drafter(hidden))
            draft = CapturedDraft(draft_graph, draft_inputs, drafts, draft_collectives)
        self.steps[size] = CapturedStep(
            size, graph, inputs, tables, logits, hidden, collectives, draft
        )

    def _capture_mixed(self, tokens: int) -> None:
        """The graph of a mixed step of up to `tokens` rows over up to min(tokens, max_num_seqs)
        sequences (paged cache), captured with every row a pad row: the model, not the LM head."""
        device, count = self.cache.device, min(tokens, self.max_num_seqs)
        inputs = torch.tensor(mixed_rows([], [], tokens, count), device=device)
        tables = torch.full(
            (count + 1, self.width), self.cache.scratch_block, dtype=torch.int32, device=device
        )

        def target():
            return decode_hidden(self.model, self.cache, inputs, tables)

        self._warm(target)
        graph, hidden, collectives = self._record(target)
        self.mixed[tokens] = CapturedStep(
            count, graph, inputs, tables, None, hidden, collectives, None
        )

    def _warm(self, run) -> None:
        """Run `run` once eagerly on a side stream before capturing it: compiles its kernels, sets
        up the communicators."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, run) -> tuple[torch.cuda.CUDAGraph, object, CommStats]:
        """Capture `run` into the memory pool all graphs share (one replays at a time) -> (the
        graph, what `run` returned: its tensors are the graph's outputs, the collectives of
        one replay)."""
        graph = torch.cuda.CUDAGraph()
        with (
            torch.no_grad(),
            count_collectives() as collectives,
            torch.cuda.graph(graph, pool=self._pool),
        ):
            out = run()
        self._pool = graph.pool()
        self.captures += 1
        return graph, out, collectives

    def step(
        self,
        ids: list[list[int]],
        locations: list,
        starts: list[int],
        stats: CommStats,
        size: int | None = None,
    ) -> torch.Tensor:
        """One decode step for `len(ids)` sequences, each feeding its T tokens `ids[i]` from
        position `starts[i]` (`locations`: their slots, or block tables) -> logits
        `[len(ids) * T, V]` (a view of the graph's output, valid until the next step; row i * T + j
        follows token j of sequence i). `size`: the graph replayed, as the DP ranks agreed (`shape`;
        None: the smallest that fits). Adds the replayed collectives to `stats`."""
        count, per_seq = len(ids), self.tokens_per_seq
        size = size or min((s for s in self.steps if s >= count), default=0)
        if size not in self.steps or count > size or any(len(t) != per_seq for t in ids):
            raise ValueError(
                f"a decode step of {count} sequences feeding {sorted({len(t) for t in ids})} "
                f"tokens in a graph of {size}; graphs were captured for {self.batch_sizes()} "
                f"sequences of {per_seq}"
            )
        captured, pad = self.steps[size], size - count
        flat_ids = [t for seq in ids for t in seq] + [0] * (pad * per_seq)
        positions = [s + j for s in starts + [0] * pad for j in range(per_seq)]
        if not self.paged:
            if any(s + per_seq > self.cache.max_len for s in starts):
                raise ValueError(
                    f"a decode position reaches {max(starts) + per_seq - 1}; the cache holds "
                    f"{self.cache.max_len}"
                )
            where = [slot for slot in locations for _ in range(per_seq)] + [
                self.cache.scratch_slot
            ] * (pad * per_seq)
            captured.inputs.copy_(torch.tensor([flat_ids, where, positions]))
        else:
            self._load_tables(captured, locations, size)
            captured.inputs[0::2].copy_(torch.tensor([flat_ids, positions]))
        captured.graph.replay()
        stats.add(captured.collectives)
        self.replayed = captured
        return captured.logits[: count * per_seq]

    def mixed_step(
        self,
        tokens: list[list[int]],
        tables: list[list[int]],
        starts: list[int],
        stats,
        size: int | None = None,
    ) -> torch.Tensor:
        """One step of the sequences feeding `tokens[i]` from position `starts[i]` into the blocks
        `tables[i]` -> the post-norm hidden `[size, H]` (the fed rows laid end to end first, then
        pad rows; valid until the next step). `size`: the graph replayed, as the DP ranks agreed
        (`shape`; None: the smallest that fits). Adds the replayed collectives to `stats`."""
        lens = [len(t) for t in tokens]
        size = size or min((n for n in self.mixed if n >= sum(lens)), default=0)
        if size not in self.mixed or sum(lens) > size or len(tokens) > self.max_num_seqs:
            raise ValueError(
                f"a step of {len(tokens)} sequences feeding {sum(lens)} tokens in a graph of "
                f"{size}; mixed graphs were captured for up to {self.max_num_seqs} sequences and "
                f"{sorted(self.mixed)} tokens"
            )
        check_room(tables, starts, lens)
        # its table rows: min(size, max_num_seqs) >= the sequences, each feeding 1+
        captured = self.mixed[size]
        self._load_tables(captured, tables, len(tables))
        captured.inputs.copy_(torch.tensor(mixed_rows(tokens, starts, size, captured.size)))
        captured.graph.replay()
        stats.add(captured.collectives)
        self.replayed = captured
        return captured.hidden

    def _load_tables(self, captured: CapturedStep, tables: list[list[int]], rows: int) -> None:
        """Write the step's block tables into the first `rows` table rows of `captured` (rows past
        `tables`: the scratch block), as wide as the widest of them (at least one block: a pad row
        writes to its first); the columns past it keep stale ids, which no row reads (each reads up
        to its own position)."""
        used = max((len(table) for table in tables), default=1)
        if used > self.width:
            raise ValueError(
                f"a block table of {used} blocks in a step; graphs were captured for {self.width} "
                "(max_model_len)"
            )
        captured.block_tables[:rows, :used].copy_(
            torch.from_numpy(padded_tables(tables, rows, used, self.cache.scratch_block))
        )

    def draft(
        self,
        next_ids: list[list[int]],
        last: list[int],
        starts: list[int | None],
        locations: list,
        stats: CommStats,
        forced: list[list[int]],
    ) -> list[list[int]]:
        """The drafter's step after the target's `step`, for its sequences (`locations`: as given to
        `step`): `next_ids[i]`: the token after each of sequence i's T fed positions (past its last
        verified one: anything); `last[i]`: the index (< T) of its last verified position;
        `starts[i]`: the position of its first one-token step (after its last verified position), or
        None for a sequence that stops this step (its steps write the scratch room: its own may end
        at its last token); `forced[i]`: the lookup's drafts that lead its slots (`draft_tokens`).
        -> the MTP layer's own k choices per sequence. Adds the replayed collectives to `stats`."""
        captured, per_seq = self.replayed, self.tokens_per_seq
        if captured is None or captured.draft is None:
            raise RuntimeError("the drafter's graph runs after a replayed speculative target step")
        size, count = captured.size, len(next_ids)
        host = torch.zeros(size * per_seq + 3 * size + size * self.drafts, dtype=torch.long)
        ids, rows, where, first, leads = self._split(host, size)
        self._pad_draft_inputs(host, size, count)
        ids[: count * per_seq] = torch.tensor([t for seq in next_ids for t in seq])
        rows[:count] = torch.tensor([i * per_seq + j for i, j in enumerate(last)])
        scratch = size if self.paged else self.cache.scratch_slot
        own = range(count) if self.paged else locations
        where[:count] = torch.tensor([scratch if s is None else w for s, w in zip(starts, own)])
        first[:count] = torch.tensor([0 if s is None else s for s in starts])
        leads[: count * self.drafts] = -1
        for i, tokens in enumerate(forced):
            leads[i * self.drafts : i * self.drafts + len(tokens)] = torch.tensor(tokens)
        captured.draft.inputs.copy_(host)
        captured.draft.graph.replay()
        stats.add(captured.draft.collectives)
        return captured.draft.drafts[:count].tolist()

    def _pad_draft_inputs(self, inputs: torch.Tensor, size: int, count: int) -> None:
        """Pad sequences count .. size - 1 of a drafter's inputs: last row their first, their
        one-token steps in the scratch room from position 0, no forced drafts."""
        _, rows, where, first, forced = self._split(inputs, size)
        rows[count:] = torch.arange(count, size, device=inputs.device) * self.tokens_per_seq
        where[count:] = size if self.paged else self.cache.scratch_slot
        first[count:] = 0
        forced[count * self.drafts :] = -1

    def _split(self, inputs: torch.Tensor, size: int) -> list[torch.Tensor]:
        """A drafter's flat inputs -> (next ids `[B * T]`, last rows `[B]`, where `[B]`, first
        positions `[B]`, forced drafts `[B * k]`)."""
        sizes = [size * self.tokens_per_seq, size, size, size, size * self.drafts]
        return list(inputs.split(sizes))
