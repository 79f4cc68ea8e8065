"""The layer plan: the token layout at every boundary of every layer, decided once from the configs.

Notation: N tokens, t TP ranks, n = ceil(N/t). Attention always takes FULL `[N, H]` rows and returns
a PARTIAL sum; what changes from layer to layer is recorded in one `LayerPlan` per decoder layer
and per MTP layer:

| field        | values                       | meaning                                            |
|--------------|------------------------------|----------------------------------------------------|
| `input`      | PARTIAL, FULL, SHARDED       | (hidden, residual) as the layer receives them,     |
|              |                              | before the attention norm                          |
| `mlp_input`  | FULL, SHARDED                | the rows the post-attention norm and the MLP / MoE |
|              |                              | run on                                             |
| `output`     | PARTIAL, SHARDED             | the MLP output: a TP partial sum of all N rows, or |
|              |                              | this rank's n complete rows; the residual travels  |
|              |                              | FULL or SHARDED with it                            |
| `moe_output` | PARTIAL, FULL, SHARDED, None | the routed experts' output: a partial sum over     |
|              |                              | this rank's experts; complete rows, the same on    |
|              |                              | every TP rank (dispatched over DP groups);         |
|              |                              | complete rows of the shard; None: dense layer      |

A layer is sequence-parallel (`use_sequence_parallel_moe`) when its MLP input is SHARDED: the MoE
layers when SP is on, every layer with `sp_scope="all"`. `spmoe.distributed.communicator` applies
the transitions.
"""

from dataclasses import dataclass

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.distributed.layout import Layout


@dataclass(frozen=True)
class LayerPlan:
    """The token layouts of one decoder or MTP layer (see the module docstring)."""

    layer_idx: int  # the checkpoint's layer index; MTP layers follow the decoder layers
    input: Layout
    mlp_input: Layout
    output: Layout
    moe_output: Layout | None

    @property
    def use_sequence_parallel_moe(self) -> bool:
        """Whether the norms and the MLP / MoE of this layer run on the token shard."""
        return self.mlp_input is Layout.SHARDED


@dataclass(frozen=True)
class ModelPlan:
    layers: tuple[LayerPlan, ...]  # the decoder layers, in order
    # the MTP layers; each takes the embedding and a hidden state, both complete
    mtp: tuple[LayerPlan, ...]

    @property
    def exit(self) -> Layout:
        """The layout the final norm takes: the last decoder layer's output."""
        return self.layers[-1].output

    def table(self) -> str:
        """The plan as a Markdown table; consecutive decoder layers with the same layouts
        share a row."""
        groups: list[list] = []  # [first index, last index, cells]
        for i, plan in enumerate(self.layers):
            if groups and groups[-1][2] == _cells(plan):
                groups[-1][1] = i
            else:
                groups.append([i, i, _cells(plan)])
        rows = [(f"layer {a}" if a == b else f"layers {a}-{b}", cells) for a, b, cells in groups]
        rows.append(("exit (final norm)", (self.exit.name, "-", "FULL", "-")))
        rows += [
            (f"MTP {i} (layer {plan.layer_idx})", _cells(plan)) for i, plan in enumerate(self.mtp)
        ]
        lines = ["| layers | input | MLP input | output | MoE output |", "|---|---|---|---|---|"]
        return "\n".join(
            lines + [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
        )


def _cells(plan: LayerPlan) -> tuple[str, ...]:
    moe = plan.moe_output.name if plan.moe_output is not None else "- (dense)"
    return plan.input.name, plan.mlp_input.name, plan.output.name, moe


def build_layer_plan(cfg: ModelConfig, parallel: ParallelConfig) -> ModelPlan:
    """The plan of every decoder layer and MTP layer of `cfg` under `parallel`.

    Layer 0 takes the embedding's PARTIAL sum: reduce-scattered into SHARDED rows when it is SP,
    else reduced by its first norm. Every later layer takes its predecessor's output as it is; a
    non-SP layer after an SP one therefore takes SHARDED rows and gathers them (hidden and residual
    in one all-gather). An MTP layer takes complete rows: SHARDED when it is SP, else FULL.
    """

    def sp(idx: int) -> bool:
        return parallel.use_sequence_parallel_moe and (
            cfg.layer_is_moe(idx) or parallel.sp_scope == "all"
        )

    def plan(idx: int, input_layout: Layout) -> LayerPlan:
        moe = None
        if cfg.layer_is_moe(idx):
            moe = (
                Layout.SHARDED
                if sp(idx)
                else Layout.FULL
                if parallel.data_parallel_size > 1
                else Layout.PARTIAL
            )
        return LayerPlan(
            idx,
            input_layout,
            Layout.SHARDED if sp(idx) else Layout.FULL,
            Layout.SHARDED if sp(idx) else Layout.PARTIAL,
            moe,
        )

    layers: list[LayerPlan] = []
    for i in range(cfg.num_hidden_layers):
        entry = Layout.SHARDED if sp(i) else Layout.PARTIAL  # the embedding's partial sum
        layers.append(plan(i, layers[-1].output if layers else entry))
    mtp_idx = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    return ModelPlan(
        tuple(layers), tuple(plan(i, Layout.SHARDED if sp(i) else Layout.FULL) for i in mtp_idx)
    )
