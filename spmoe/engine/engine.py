"""The generation loop: batched prefill, decode steps, sequences that finish at different times, and
optional MTP speculation.

Every rank of the TP group runs this loop on the same inputs. The logits are identical on every rank (the
LM head gathers them), so every rank picks the same tokens and the ranks stay in step without exchanging
them.

One step:
1. Admit waiting prompts while the KV cache has free slots.
2. One target forward over every live sequence's pending tokens, laid end to end: a new sequence's whole
   prompt (prefill), else its last token followed by its drafts when speculating. A plain decode step
   therefore has N = the number of live sequences: N = 1, 2 or 3 on 2 to 4 ranks is the everyday case.
3. Commit: sample from each sequence's last row, or accept drafts greedily (`speculative.py`).
4. Finish sequences at an eos id or `max_new_tokens`; free their slots.
5. When speculating, the drafter proposes the next drafts from the verified positions.

With `cuda_graphs`, plain decode steps replay a captured graph (`cuda_graphs.py`); prefill stays eager.
"""

import time
from collections import deque
from itertools import accumulate
from dataclasses import dataclass, field

import torch

from spmoe.distributed import CommStats, count_collectives, get_parallel_state
from spmoe.distributed.comm import all_reduce
from spmoe.engine.cuda_graphs import DecodeGraphs
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.sampling import Sampler, SamplingParams, greedy
from spmoe.engine.speculative import MtpDrafter, accept_greedy
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

PHASES = ("prefill", "decode", "draft")


@dataclass
class Sequence:
    index: int
    prompt: list[int]
    slot: int = -1
    cached: int = 0  # tokens of this sequence in the target's KV cache
    pending: list[int] = field(default_factory=list)  # what the next target forward feeds
    drafts: list[int] = field(default_factory=list)  # the tail of `pending` that MTP drafted
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # `[V]` per committed token, when recorded
    finished: bool = False


@dataclass
class Phase:
    forwards: int = 0
    tokens_fed: int = 0
    tokens_committed: int = 0
    seconds: float = 0.0
    collectives: CommStats = field(default_factory=CommStats)

    def as_dict(self) -> dict:
        return {"forwards": self.forwards, "tokens_fed": self.tokens_fed, "tokens_committed": self.tokens_committed,
                "seconds": self.seconds, "collectives": self.collectives.as_dict()}


@dataclass
class Generation:
    outputs: list[list[int]]
    stats: dict
    logits: list[torch.Tensor] | None  # per sequence `[len(output), V]` float32, when recorded


def check_prompts(prompts: list[list[int]], vocab_size: int, max_new_tokens: int, drafts: int, max_len: int) -> None:
    """Raise unless every prompt is valid and fits the KV cache with its new tokens and drafts."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if not prompt or any(not 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"prompt {i} must be a non-empty list of token ids in [0, {vocab_size}), got "
                             f"{str(prompt)[:60]}")
        if len(prompt) + max_new_tokens + drafts > max_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} and "
                             f"{drafts} speculative tokens it needs {len(prompt) + max_new_tokens + drafts} KV "
                             f"cache positions, the cache holds {max_len} per sequence")


class Engine:
    def __init__(self, model: DeepseekV32ForCausalLM, cache: KVCache, sampling: SamplingParams = SamplingParams(),
                 eos_token_ids: tuple[int, ...] = (), num_speculative_tokens: int = 0, cuda_graphs: bool = False):
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if num_speculative_tokens and not model.num_draft_layers:
            raise ValueError("speculative decoding needs the MTP layer: load the model with with_mtp=True")
        if num_speculative_tokens and not sampling.greedy:
            raise ValueError(f"speculative decoding accepts drafts greedily; expected temperature 0, got "
                             f"{sampling.temperature}")
        if num_speculative_tokens and cuda_graphs:
            raise ValueError("CUDA graphs capture the plain decode step only; speculative decoding runs eagerly, "
                             "so pass one or the other")
        self.model, self.cache, self.eos_token_ids = model, cache, set(eos_token_ids)
        self.sampler = Sampler(sampling)
        self.k = num_speculative_tokens
        self.drafter = MtpDrafter(model, cache, num_speculative_tokens) if num_speculative_tokens else None
        self.graphs = DecodeGraphs(model, cache) if cuda_graphs else None

    def generate(self, prompts: list[list[int]], max_new_tokens: int, record_logits: bool = False,
                 on_step=None) -> Generation:
        """Generate up to `max_new_tokens` after each prompt. `on_step(done_tokens, live_sequences)` is called
        after every step (for progress output)."""
        check_prompts(prompts, self.model.cfg.vocab_size, max_new_tokens, self.k, self.cache.max_len)
        seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
        waiting, live = deque(seqs), []
        self.phases = {name: Phase() for name in PHASES}
        self.accepted_per_step: list[int] = []
        start = time.perf_counter()
        with torch.no_grad():
            while self._any_rank_busy(bool(waiting or live)):
                while waiting and self.cache.free_slots:
                    seq = waiting.popleft()
                    seq.slot, seq.pending = self.cache.allocate(), list(seq.prompt)
                    live.append(seq)
                self._step(live, max_new_tokens, record_logits)
                for seq in [s for s in live if s.finished]:
                    self.cache.release(seq.slot)
                    live.remove(seq)
                if on_step is not None:
                    on_step(sum(len(s.output) for s in seqs), len(live))
        return Generation([s.output for s in seqs], self._stats(seqs, time.perf_counter() - start),
                          [torch.stack(s.logits) for s in seqs] if record_logits else None)

    def _any_rank_busy(self, busy: bool) -> bool:
        """With DP > 1 every rank runs every step (the MoE dispatch spans all of them), so a DP rank that is
        done keeps stepping with an empty batch until every rank is done: one tiny all-reduce per step."""
        state = get_parallel_state()
        if state.dp_size == 1:
            return busy
        flag = torch.tensor([int(busy)], device=state.device)
        return bool(all_reduce(flag, state.ep_group, op=torch.distributed.ReduceOp.MAX).item())

    def _step(self, live: list[Sequence], max_new_tokens: int, record_logits: bool) -> None:
        phase = self.phases["prefill" if any(s.cached == 0 for s in live) else "decode"]
        began = time.perf_counter()
        with count_collectives(phase.collectives):
            lens = [len(s.pending) for s in live]
            ends = list(accumulate(lens))
            if self.graphs is not None and phase is self.phases["decode"]:  # one token per sequence
                logits = self.graphs.step([s.pending[0] for s in live], [s.slot for s in live],
                                          [s.cached for s in live], phase.collectives)
            else:
                view = self.cache.view([s.slot for s in live], [s.cached for s in live], lens)
                ids = torch.tensor([t for s in live for t in s.pending], dtype=torch.long,
                                   device=view.positions.device)
                hidden = self.model.forward_hidden(ids, view.positions, lens, view)  # FULL [N, H]
                rows = [r for s, end in zip(live, ends) for r in range(end - 1 - len(s.drafts), end)]
                logits = self.model.compute_logits(hidden, torch.tensor(rows, dtype=torch.long, device=hidden.device))
        to_draft, row = [], 0
        for seq, end, n in zip(live, ends, lens):
            seq_logits = logits[row:row + 1 + len(seq.drafts)]
            row += 1 + len(seq.drafts)
            if seq.drafts:
                choices, finite = greedy(seq_logits)
                accepted, new = accept_greedy(seq.drafts, choices)
                self.accepted_per_step.append(accepted)
            else:
                (new, finite), accepted = self.sampler(seq_logits), 0
            if not all(finite[:len(new)]):
                step = self.phases["prefill"].forwards + self.phases["decode"].forwards + 1
                raise FloatingPointError(
                    f"non-finite logits (NaN or inf) at step {step} ({'prefill' if seq.cached == 0 else 'decode'}) "
                    f"for sequence {seq.index} after {len(seq.output)} generated tokens: no token can be chosen, "
                    f"so the run stops (check the checkpoint for NaN / inf weights)")
            verified = n - (len(seq.drafts) - accepted)  # fed tokens whose cache rows stay valid
            for j, token in enumerate(new):
                seq.output.append(token)
                phase.tokens_committed += 1
                if record_logits:
                    seq.logits.append(seq_logits[j].cpu())
                if token in self.eos_token_ids or len(seq.output) == max_new_tokens:
                    seq.finished = True
                    break
            if self.drafter is not None and not seq.finished:
                to_draft.append((seq, seq.cached, seq.pending[1:verified] + [new[-1]],
                                 hidden[end - n:end - n + verified]))
            seq.cached += verified
            seq.pending, seq.drafts = [new[-1]], []
        phase.forwards += 1
        phase.tokens_fed += sum(lens)
        phase.seconds += time.perf_counter() - began
        if self.drafter is not None and (to_draft or get_parallel_state().dp_size > 1):
            self._draft(to_draft)  # under DP even an empty draft step runs, to keep the ranks in step

    def _draft(self, to_draft: list) -> None:
        phase, began = self.phases["draft"], time.perf_counter()
        with count_collectives(phase.collectives):
            hidden = [h for *_, h in to_draft] or [torch.zeros(0, self.model.cfg.hidden_size, dtype=self.cache.dtype, device=self.cache.device)]
            drafts = self.drafter.propose([s.slot for s, *_ in to_draft], [start for _, start, _, _ in to_draft],
                                          [ids for *_, ids, _ in to_draft], torch.cat(hidden))
        for (seq, *_), proposed in zip(to_draft, drafts):
            seq.drafts = proposed
            seq.pending = seq.pending + proposed
        phase.forwards += self.k
        phase.tokens_fed += sum(len(ids) for *_, ids, _ in to_draft) + (self.k - 1) * len(to_draft)
        phase.seconds += time.perf_counter() - began

    def _stats(self, seqs: list[Sequence], seconds: float) -> dict:
        generated = sum(len(s.output) for s in seqs)
        decode = self.phases["decode"]
        decode_s = decode.seconds + self.phases["draft"].seconds
        stats = {
            "sequences": len(seqs), "prompt_tokens": sum(len(s.prompt) for s in seqs), "generated_tokens": generated,
            "seconds": seconds, "tokens_per_s": generated / seconds if seconds else 0.0,
            "prefill_s": self.phases["prefill"].seconds, "decode_s": decode_s,
            "decode_tokens_per_s": decode.tokens_committed / decode_s if decode_s else 0.0,
            "phases": {name: phase.as_dict() for name, phase in self.phases.items()},
            "kv_cache": {"bytes_per_token": self.cache.bytes_per_token, "slots": self.cache.max_seqs,
                         "max_len": self.cache.max_len},
            "cuda_graph_batch_sizes": sorted(self.graphs.steps) if self.graphs else [],
        }
        if self.k:
            steps, accepted = len(self.accepted_per_step), sum(self.accepted_per_step)
            stats["speculative"] = {
                "num_speculative_tokens": self.k, "verify_steps": steps, "proposed": steps * self.k,
                "accepted": accepted, "acceptance_rate": accepted / (steps * self.k) if steps else 0.0,
                "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
                "per_position": [sum(a > j for a in self.accepted_per_step) / steps if steps else 0.0
                                 for j in range(self.k)],
            }
        return stats
