"""One target forward for a step: the flat batch of every scheduled sequence's tokens, run eagerly or, for a
plain decode step, replayed from a CUDA graph (`cuda_graphs.py`); the logits of the rows the step commits
from."""

from itertools import accumulate

import torch

from spmoe.distributed import CommStats
from spmoe.engine.cuda_graphs import DecodeGraphs
from spmoe.engine.kv_cache import KVCache
from spmoe.engine.paged_cache import PagedKVCache
from spmoe.models.deepseek_v32.model import DeepseekV32ForCausalLM


class ModelRunner:
    def __init__(
        self, model: DeepseekV32ForCausalLM, cache: KVCache | PagedKVCache, max_num_seqs: int, cuda_graphs: bool = False
    ):
        self.model, self.cache = model, cache
        self.graphs = DecodeGraphs(model, cache, max_num_seqs) if cuda_graphs else None

    def run(
        self,
        tokens: list[list[int]],
        locations: list,
        starts: list[int],
        logit_rows: list[int],
        decode: bool,
        collectives: CommStats,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequence i feeds `tokens[i]` at positions `starts[i] ...` of its cache room `locations[i]` (a slot of
        the slot cache, a block table of the paged one) and wants the logits of its last `logit_rows[i]` rows
        (0: none, a prompt chunk). -> (logits `[sum(logit_rows), V]` float32, the FULL post-norm hidden `[N, H]`
        of all N fed tokens, or None when a CUDA graph ran). `decode`: every sequence feeds one token after its
        cached prefix and wants its logits, so a captured graph can run it. No sequences: an empty forward (a
        DP rank that must keep in step). Replayed collectives are added to `collectives`."""
        lens = [len(t) for t in tokens]
        if self.graphs is not None and decode:
            return self.graphs.step([t[0] for t in tokens], locations, starts, collectives), None
        view = self.cache.view(locations, starts, lens)
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=view.positions.device)
        hidden = self.model.forward_hidden(ids, view.positions, lens, view)  # FULL [N, H]
        rows = [r for end, m in zip(accumulate(lens), logit_rows) for r in range(end - m, end)]
        return self.model.compute_logits(hidden, torch.tensor(rows, dtype=torch.long, device=hidden.device)), hidden
