"""Rotary position embedding: default and yarn frequencies; interleaved and half-split rotation.

Attention rotates the rope parts of q and k in place (`rotate_`): on CUDA one Triton kernel
(`fused_triton.rope_`) per call, with no `cat`; the out-of-place torch forms are the reference.

cos/sin come from `cos_sin` (float32 angles, then cos and sin scaled and cast). A model on CUDA
computes them once for every position up to `max_position_embeddings` (`RotaryTable`) and a forward
gathers its rows (one kernel, where `cos_sin` takes about eight); the rows are `cos_sin`'s own
values, as the table is made by it."""

import math

import torch

from spmoe.config import ModelConfig
from spmoe.layers.fused import use_fused


def inverse_frequencies(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    """`[rope_dim / 2]` inverse frequencies on `device` (made there: no host copy, so a CUDA graph
    can capture them) and the cos/sin scale (yarn's attention factor, else 1)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if cfg.rope_type == "default":
        return inv_freq, 1.0
    factor, original_max, beta_fast, beta_slow, mscale, mscale_all_dim, truncate = cfg.rope_scaling

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / max(high - low, 0.001)
    ).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def yarn_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    scale = (
        yarn_mscale(mscale) / yarn_mscale(mscale_all_dim)
        if mscale and mscale_all_dim
        else yarn_mscale(1.0)
    )
    return inv_freq, scale


def cos_sin(
    cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions `[N]` -> cos, sin `[N, rope_dim / 2]` in `dtype`, scaled; computed in float32."""
    inv_freq, scale = inverse_frequencies(cfg, positions.device)
    angles = positions.float().unsqueeze(1) * inv_freq
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


class RotaryTable:
    """`cos_sin` of positions 0 .. size - 1, made once: `table` `[size, 2, rope_dim / 2]`
    (cos, then sin)."""

    def __init__(self, cfg: ModelConfig, size: int, device: torch.device | str, dtype: torch.dtype):
        self.table = torch.stack(cos_sin(cfg, torch.arange(size, device=device), dtype), dim=1)

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype
    ) -> "RotaryTable | None":
        """The table of a model on `device`: on CUDA when the config states
        `max_position_embeddings` (the positions the model takes; the engine and the entrypoints
        refuse more), else None (every forward computes its rows)."""
        if torch.device(device).type != "cuda" or not cfg.max_position_embeddings:
            return None
        return cls(cfg, cfg.max_position_embeddings, device, dtype)

    def serves(self, positions: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the table holds rows for `positions`' device and `dtype` (the values are
        not looked at)."""
        return self.table.device == positions.device and self.table.dtype == dtype

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[N]` int64, each below the table's size -> cos, sin `[N, rope_dim / 2]`: views
        of one gather `[N, 2, rope_dim / 2]`, so both have the same strides, and a
        unit-stride last dim."""
        rows = self.table.index_select(0, positions)
        return rows[:, 0], rows[:, 1]


class Rotary:
    """cos/sin for the positions of one forward, each `[N, rope_dim / 2]` (already scaled)."""

    def __init__(
        self,
        cfg: ModelConfig,
        positions: torch.Tensor,
        dtype: torch.dtype,
        table: RotaryTable | None = None,
    ):
        """table: the model's `RotaryTable`, whose rows are looked up when the fused kernels are on
        (`use_fused`); else (and on CPU) `cos_sin` computes them, the reference."""
        if table is not None and use_fused(positions) and table.serves(positions, dtype):
            self.cos, self.sin = table.lookup(positions)
        else:
            self.cos, self.sin = cos_sin(cfg, positions, dtype)

    def interleaved(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, heads, d]`, pairs (x0, x1), (x2, x3)... -> the rotated evens, then the
        rotated odds."""
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    def half_split(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, heads, d]`, pairs (x_i, x_{i+d/2})."""
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def rotate_(self, x: torch.Tensor, interleaved: bool) -> None:
        """Rotates x `[N, heads, d]` in place: a view of the rope part of q or k (last dim
        contiguous). The result is `interleaved(x)` or `half_split(x)`."""
        if use_fused(x):
            from spmoe.layers.fused_triton import rope_

            rope_(x, self.cos, self.sin, interleaved)
        else:
            x.copy_(self.interleaved(x) if interleaved else self.half_split(x))
