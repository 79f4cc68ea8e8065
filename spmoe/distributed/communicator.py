"""The one place where tokens change layout: the transitions of the layer plan (`layer_plan.py`),
built on the layout primitives (`layout.py`). Layers, norms and the MoE never decide or perform
a layout change.

Per layer (`LayerCommunicator`), with N tokens, t TP ranks, n = ceil(N/t):

    before attention  input PARTIAL: all-reduce + add-norm (`fused_allreduce_rms_norm`)
                        -> h FULL, residual FULL
                      input SHARDED, layer SP: add-norm on the shard, all-gather h (H)
                        -> h FULL, residual SHARDED
                      input SHARDED, layer not SP: all-gather (hidden | residual) (2H)
                        once (`_restore_full_token_layout_if_needed`), add-norm
                        -> h FULL, residual FULL
                      input FULL: add-norm -> h FULL, residual FULL
    before the MLP    layer SP: reduce-scatter the attention output, chunk a FULL residual
                        locally (no communication), add-norm on the shard -> SHARDED
                      layer not SP: all-reduce + add-norm -> FULL

Around the layers: `enter` brings the embedding's PARTIAL sum into the first layer's input layout,
and `final_norm` turns the last output into FULL normed rows. A norm here is an RMSNorm: `weight`,
`eps` and `add_norm(x, residual) -> (norm(x + residual), x + residual)`.

Where the TP group runs one-shot kernels (CUDA, > 1 rank) and the rows fit them, a collective and
the add-norm next to it are one kernel (`comm.one_shot_add_rms_norm`): all-reduce + add-norm,
reduce-scatter + add-norm, and add-norm + all-gather, so SP on launches no more kernels per
transition than SP off.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmoe.distributed.comm import all_reduce, one_shot_add_rms_norm
from spmoe.distributed.groups import get_parallel_state
from spmoe.distributed.layer_plan import LayerPlan
from spmoe.distributed.layout import (
    Layout,
    _restore_full_token_layout_if_needed,
    check_rows,
    shard_rows,
    sp_all_gather,
    sp_reduce_scatter,
    sp_shard,
)


def fused_allreduce_rms_norm(partial: torch.Tensor, residual: torch.Tensor | None, norm):
    """PARTIAL `[N, H]` + FULL residual `[N, H]` (or None) -> (normed, new residual),
    both FULL `[N, H]`.

    The one entry point for "reduce a partial sum exactly once, add the residual, RMSNorm". Where
    the TP group runs one-shot kernels and the tensor fits them, one kernel does all three;
    otherwise an all-reduce over the TP group (in place) and then the norm's fused add-norm. Never
    called on an SP layer, whose tensors are already complete.
    """
    state = get_parallel_state()
    if state.tp_size > 1:
        fused = one_shot_add_rms_norm(
            "all_reduce", partial, residual, norm, partial.shape[0], state.tp_group
        )
        if fused is not None:
            return fused
        partial = all_reduce(partial, state.tp_group)
    return norm.add_norm(partial, residual)


def enter(partial: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The embedding's PARTIAL `[N, H]` -> `layout`: unchanged for PARTIAL (the first norm reduces
    it), all-reduced for FULL, reduce-scattered into `[n, H]` for SHARDED."""
    if layout is Layout.SHARDED:
        return sp_reduce_scatter(partial)
    state = get_parallel_state()
    if layout is Layout.FULL and state.tp_size > 1:
        return all_reduce(partial, state.tp_group)
    return partial


def shard_like(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A FULL `[N, ...]` tensor in `layout`: this rank's `[n, ...]` rows for SHARDED (no
    communication), else unchanged."""
    return sp_shard(full) if layout is Layout.SHARDED else full


def final_norm(
    hidden: torch.Tensor, residual: torch.Tensor, norm, layout: Layout, num_tokens: int
) -> torch.Tensor:
    """The last layer's (output, residual) in `layout` -> FULL `[N, H]` normed rows.

    SHARDED: the output is complete, so add-norm on the shard and gather H columns (not 2H).
    PARTIAL: reduce the partial sum exactly once, with the add-norm.
    """
    if layout is Layout.SHARDED:
        return sp_all_gather(norm.add_norm(hidden, residual)[0], num_tokens)
    return fused_allreduce_rms_norm(hidden, residual, norm)[0]


@dataclass(frozen=True)
class ExpertRows:
    """What one MoE call needs to know about its rows, from the layer plan and this step."""

    valid: int  # the real rows of the input; the rest are SP pad rows, which get no experts
    # the EP process group to dispatch over; None: run this rank's experts on every row
    group: dist.ProcessGroup | None
    rows_max: int  # the largest row count over the EP group: every rank pads its block to it
    # False: a TP peer keeps the same complete routed output, this rank contributes zero
    keep_output: bool
    tokens: int  # this DP group's N
    sharded: bool  # whether the input is this rank's SP shard of the N rows (else all N)


class LayerCommunicator:
    """Applies one layer's transitions, as its `LayerPlan` declares them (see the
    module docstring)."""

    def __init__(self, plan: LayerPlan):
        self.plan = plan
        self.residual_sharded = plan.input is Layout.SHARDED and plan.use_sequence_parallel_moe

    def before_attention(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in `plan.input` -> (normed FULL `[N, H]` attention
        input, residual)."""
        plan, t = self.plan, get_parallel_state().tp_size
        rows = shard_rows(num_tokens, t) if plan.input is Layout.SHARDED else num_tokens
        check_rows(
            hidden, rows, f"layer {plan.layer_idx} input ({plan.input.name}, N={num_tokens})"
        )
        if plan.input is Layout.PARTIAL:
            return fused_allreduce_rms_norm(hidden, residual, norm)
        if self.residual_sharded:
            fused = one_shot_add_rms_norm(
                "all_gather", hidden, residual, norm, num_tokens, get_parallel_state().tp_group
            )
            if fused is not None:
                return fused
            h, residual = norm.add_norm(hidden, residual)
            return sp_all_gather(h, num_tokens), residual
        hidden, residual = _restore_full_token_layout_if_needed(
            hidden, residual, num_tokens, is_sequence_parallel=plan.input is Layout.SHARDED
        )
        return norm.add_norm(hidden, residual)

    def before_mlp(
        self, attn: torch.Tensor, residual: torch.Tensor, norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's PARTIAL `[N, H]` + residual -> (normed MLP input, residual), both in
        `plan.mlp_input`."""
        if not self.plan.use_sequence_parallel_moe:
            return fused_allreduce_rms_norm(attn, residual, norm)
        if not self.residual_sharded:
            residual = sp_shard(residual)  # FULL -> SHARDED, no communication
        fused = one_shot_add_rms_norm(
            "reduce_scatter", attn, residual, norm, attn.shape[0], get_parallel_state().tp_group
        )
        if fused is not None:
            return fused
        # the reduce-scatter leaves [n, H], complete
        return norm.add_norm(sp_reduce_scatter(attn), residual)

    def expert_rows(self, num_tokens: int, max_tokens: int) -> ExpertRows:
        """num_tokens: this DP rank's N; max_tokens: the largest N over the DP ranks
        (`largest_dp_batch`)."""
        state, moe = get_parallel_state(), self.plan.moe_output
        if moe is Layout.SHARDED:
            n = shard_rows(num_tokens, state.tp_size)
            valid = min(n, max(0, num_tokens - state.tp_rank * n))  # pad rows sit at the tail
            rows_max = shard_rows(max_tokens, state.tp_size)
            return ExpertRows(valid, state.ep_group, rows_max, True, num_tokens, True)
        # every TP rank gets the same complete rows back; one keeps them -> PARTIAL
        if moe is Layout.FULL:
            keep = state.tp_rank == 0
            return ExpertRows(num_tokens, state.ep_group, max_tokens, keep, num_tokens, False)
        return ExpertRows(num_tokens, None, num_tokens, True, num_tokens, False)
