"""CUDA graphs for the plain decode step (one new token per live sequence), SP on or off.

Launching a decode step's few hundred small kernels and collectives one by one costs more than running them
at small batches. Instead, at start-up, the step (the model, then the LM head) is captured once per padded
batch size B in `BATCH_SIZES` up to the cache's slot count, and each decode step replays the smallest graph
that fits. Pad rows get token 0 at position 0 in the KV cache's scratch slot; they attend only themselves and
their logits are dropped.

Captured, the step must not sync the host nor change shape with the data. Hence it needs: DP = 1 (DP ranks
would have to agree on B each step), the `allgather_reducescatter` dispatch (`all_to_all` reads its counts
back), experts that never sync the host (not the torch reference), and a CUDA device.
"""

from dataclasses import dataclass

import torch

from spmoe.distributed import CommStats, count_collectives, get_parallel_state
from spmoe.engine.kv_cache import KVCache
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [3, B] int64: token ids, KV cache slots, positions
    logits: torch.Tensor  # [B, V] float32, rewritten by each replay
    collectives: CommStats  # of one replay, counted at capture


def deployment_problems(device_type: str, dp_size: int, ep_backend: str) -> list[str]:
    """What the deployment lacks for captured decode steps (empty if nothing), known before any rank starts.
    Whether the experts can be captured is known only once they are built."""
    problems = []
    if device_type != "cuda":
        problems.append(f"a CUDA device (the model is on {device_type})")
    if dp_size > 1:
        problems.append(f"data_parallel_size 1 (got {dp_size})")
    if ep_backend != "allgather_reducescatter":
        problems.append(f"ep_backend 'allgather_reducescatter' (got {ep_backend!r})")
    return problems


def graph_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured for up to `max_batch` sequences."""
    return [b for b in BATCH_SIZES if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model: DeepseekV32ForCausalLM, cache: KVCache):
        """Captures one graph per size in `graph_sizes(cache.max_seqs)`, on every rank in the same order."""
        problems = deployment_problems(cache.device.type, get_parallel_state().dp_size, model.parallel.ep_backend)
        capturable, experts = model.graph_capturable
        if not capturable:
            problems.append(f"experts that never sync the host (got moe backend {experts!r}; bfloat16 on a GPU "
                            f"picks triton)")
        if problems:
            raise ValueError("CUDA graphs for decode need " + "; ".join(problems))
        self.model, self.cache = model, cache
        self.steps: dict[int, CapturedStep] = {}
        pool = None
        for size in reversed(graph_sizes(cache.max_seqs)):  # largest first, the others reuse its memory
            self.steps[size] = self._capture(size, pool)
            pool = self.steps[size].graph.pool()

    def eager_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """The captured step, run eagerly: inputs `[3, B]` (ids, slots, positions) -> logits `[B, V]`."""
        ids, slots, positions = inputs
        view = self.cache.decode_view(slots, positions)
        return self.model.compute_logits(self.model.forward_hidden(ids, positions, [1] * ids.shape[0], view))

    def _capture(self, size: int, pool) -> CapturedStep:
        inputs = torch.zeros(3, size, dtype=torch.long, device=self.cache.device)
        inputs[1] = self.cache.scratch_slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sets up communicators
                self.eager_step(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with count_collectives() as collectives, torch.cuda.graph(graph, pool=pool):
                logits = self.eager_step(inputs)
        return CapturedStep(graph, inputs, logits, collectives)

    def step(self, ids: list[int], slots: list[int], positions: list[int], stats: CommStats) -> torch.Tensor:
        """One decode step for `len(ids)` sequences -> logits `[len(ids), V]` (a view of the graph's output,
        valid until the next step). Adds the replayed collectives to `stats`."""
        count = len(ids)
        if count > self.cache.max_seqs:
            raise ValueError(f"{count} sequences in one decode step; graphs were captured for up to "
                             f"{self.cache.max_seqs}")
        if any(p >= self.cache.max_len for p in positions):
            raise ValueError(f"a decode position reaches {max(positions)}; the cache holds {self.cache.max_len}")
        captured = self.steps[min(size for size in self.steps if size >= count)]
        pad = captured.inputs.shape[1] - count
        host = torch.tensor([ids + [0] * pad, slots + [self.cache.scratch_slot] * pad, positions + [0] * pad])
        captured.inputs.copy_(host)
        captured.graph.replay()
        stats.add(captured.collectives)
        return captured.logits[:count]
