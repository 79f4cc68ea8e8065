"""Preallocated KV cache for MLA + DSA attention, one slot per live sequence.

Per token and attention layer it keeps what attention reads back on later steps:

- "mla": the normed compressed latent with the rotated rope key, `kv_lora_rank +
  qk_rope_head_dim` values;
- "indexer": on layers that run the DSA indexer, the indexer's key, `index_head_dim` values.

Both are replicated on every TP rank (MLA's latent is shared by all heads, the indexer is
replicated). Buffers are flat `[(max_seqs + 1) * max_len, width]`; slot s owns rows
`[s * max_len, (s + 1) * max_len)`. The extra slot, `scratch_slot`, is never allocated: the pad rows
of a CUDA-graph decode step write there.
"""

from dataclasses import dataclass

import torch
from torch import nn

from spmoe.config import ModelConfig


def _widths(cfg: ModelConfig) -> dict[str, int]:
    return {"mla": cfg.kv_lora_rank + cfg.qk_rope_head_dim, "indexer": cfg.index_head_dim}


def _kinds(has_indexer: bool) -> tuple[str, ...]:
    return ("mla", "indexer") if has_indexer else ("mla",)


@dataclass
class CacheView:
    """The cache as one forward sees it: N new tokens (written at `write_index` `[N]`) attend K keys
    (read at `read_index` `[K]`). `positions` `[N]` are the new tokens' positions, `allowed`
    `[N, K]` bool."""

    buffers: dict[int, dict[str, torch.Tensor]]
    write_index: torch.Tensor
    read_index: torch.Tensor
    positions: torch.Tensor
    allowed: torch.Tensor

    def store_and_read(self, layer: int, kind: str, new: torch.Tensor) -> torch.Tensor:
        """new `[N, w]` -> `[K, w]`: write this forward's rows, then read every key the
        batch attends."""
        buffer = self.buffers[layer][kind]
        buffer.index_copy_(0, self.write_index, new)
        return buffer[self.read_index]


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        layers: dict[int, bool],
        max_seqs: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        """layers: attention layer index -> whether it runs the indexer. Room for `max_seqs`
        sequences of up to `max_len` tokens each."""
        if max_seqs < 1 or max_len < 1:
            raise ValueError(
                f"the KV cache needs max_seqs >= 1 and max_len >= 1, got {max_seqs} and {max_len}"
            )
        widths = _widths(cfg)
        self.max_seqs, self.max_len, self.dtype, self.device = (
            max_seqs,
            max_len,
            dtype,
            torch.device(device),
        )
        self.scratch_slot = max_seqs
        self.buffers = {
            layer: {
                kind: torch.zeros(
                    (max_seqs + 1) * max_len, widths[kind], dtype=dtype, device=device
                )
                for kind in _kinds(has_indexer)
            }
            for layer, has_indexer in layers.items()
        }
        self._free = list(range(max_seqs - 1, -1, -1))

    @staticmethod
    def size_bytes(
        cfg: ModelConfig, layers: dict[int, bool], max_seqs: int, max_len: int, dtype: torch.dtype
    ) -> int:
        """The bytes a cache with these arguments allocates on each rank (scratch slot included),
        computed without allocating."""
        widths = _widths(cfg)
        per_token = sum(
            widths[kind] for has_indexer in layers.values() for kind in _kinds(has_indexer)
        )
        return per_token * dtype.itemsize * (max_seqs + 1) * max_len

    def describe(self) -> str:
        """One line for the start-up log: the cache's dtype and capacity on each rank."""
        gib = sum(
            b.numel() * b.element_size() for kinds in self.buffers.values() for b in kinds.values()
        )
        return (
            f"dense KV cache {str(self.dtype).removeprefix('torch.')}: {self.max_seqs} slots of "
            f"{self.max_len} positions = {self.max_seqs * self.max_len} tokens, "
            f"{gib / 2**30:.3g} GiB on each rank"
        )

    @classmethod
    def for_model(cls, model: nn.Module, max_seqs: int, max_len: int) -> "KVCache":
        """A cache for every attention layer in `model` (the MTP layer's included), in the
        model's dtype."""
        cfg, layers, dtype, device = cache_layout(model)
        return cls(cfg, layers, max_seqs, max_len, dtype, device)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers (on each rank)."""
        return sum(
            b.shape[1] * b.element_size() for kinds in self.buffers.values() for b in kinds.values()
        )

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ValueError(f"the KV cache is full: all {self.max_seqs} slots hold live sequences")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def view(self, slots: list[int], starts: list[int], lens: list[int]) -> CacheView:
        """One forward in which sequence i (slot `slots[i]`, `starts[i]` tokens already cached) adds
        `lens[i]` new tokens at positions `starts[i] ...`."""
        device = self.device
        for slot, start, n in zip(slots, starts, lens):
            if start + n > self.max_len:
                raise ValueError(
                    f"the sequence in KV cache slot {slot} needs {start + n} positions; the cache "
                    f"holds {self.max_len} per sequence"
                )

        def flat(
            first: list[int], counts: list[int]
        ):  # (sequence index, position) of each row, rows laid out
            seq = torch.repeat_interleave(
                torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long)
            )
            pos = [torch.zeros(0, dtype=torch.long)] + [
                torch.arange(f, f + c) for f, c in zip(first, counts)
            ]
            return seq.to(device), torch.cat(pos).to(device)

        slot_of = torch.tensor(slots, dtype=torch.long, device=device)
        q_seq, q_pos = flat(starts, lens)
        k_seq, k_pos = flat([0] * len(slots), [s + n for s, n in zip(starts, lens)])
        allowed = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        return CacheView(
            self.buffers,
            slot_of[q_seq] * self.max_len + q_pos,
            slot_of[k_seq] * self.max_len + k_pos,
            q_pos,
            allowed,
        )

    def decode_view(self, slots: torch.Tensor, positions: torch.Tensor) -> CacheView:
        """One decode step built on the device from `slots` and `positions` `[B]` (int64): row i
        adds the token at `positions[i]` to the sequence in slot `slots[i]`. Every shape depends on
        B alone and nothing is read back to the host, so a CUDA graph can capture it; each row reads
        all `max_len` rows of its slot (K = B * max_len) and `allowed` keeps
        positions <= its own."""
        b, length = slots.shape[0], self.max_len
        offsets = torch.arange(length, device=slots.device)
        rows = torch.arange(b, device=slots.device)
        read_index = (slots[:, None] * length + offsets).flatten()  # [B * max_len]
        allowed = (rows[:, None, None] == rows[None, :, None]) & (
            offsets <= positions[:, None, None]
        )
        return CacheView(
            self.buffers, slots * length + positions, read_index, positions, allowed.view(b, -1)
        )


def cache_layout(
    model: nn.Module,
) -> tuple[ModelConfig, dict[int, bool], torch.dtype, torch.device]:
    """(config, attention layer index -> whether it runs the indexer, dtype, device) of the
    attention layers `model` declares (`kv_cache_needs`: the MTP layer's included)."""
    needs = model.kv_cache_needs()
    return model.cfg, {n.layer: n.index_key > 0 for n in needs}, needs[0].dtype, needs[0].device
