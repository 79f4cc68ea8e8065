"""The parallel configuration: validated once, at build time.

World layout: `world = dp * tp`. Rank `r` sits in DP group `r // tp` at TP rank `r % tp`; the TP
group holds consecutive ranks, and the expert-parallel (EP) group spans all `dp * tp` ranks.

`sp` is the request (the CLI's `--sp`: auto, on or off); `use_sequence_parallel_moe` is the decision
it resolves to. The layer plan (`spmoe.distributed.layer_plan`) reads that decision and `sp_scope`
(which layers it covers) and derives every layer's layouts from them.
"""

from dataclasses import dataclass

SP_MODES = ("auto", "on", "off")
SP_SCOPES = ("moe", "all")
EP_BACKENDS = ("allgather_reducescatter", "all_to_all")
# see spmoe/layers/moe/experts/selection.py
MOE_BACKENDS = (
    "auto",
    "torch",
    "triton",
    "flashinfer_trtllm",
)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = True
    sp: str = "auto"  # one of SP_MODES
    sp_scope: str = "moe"  # one of SP_SCOPES: only MoE layers are SP, or every layer
    # one of EP_BACKENDS: how SP layers dispatch to experts
    ep_backend: str = "allgather_reducescatter"
    moe_backend: str = "auto"  # one of MOE_BACKENDS: the expert kernels
    # Measurement only (spmoe.distributed.simulated): rank 0 of this layout runs in one process, the
    # other ranks simulated; `routing_seed` makes every router's top-k a seeded function of (layer,
    # token) (the simulated rank's default 0; set alone, a real run routes the same way);
    # `simulated_load`: "rank0" or "busiest" (each layer's busiest EP rank's experts on this rank).
    simulate_rank: bool = False
    routing_seed: int | None = None
    simulated_load: str = "rank0"

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, allowed in (
            ("sp", SP_MODES),
            ("sp_scope", SP_SCOPES),
            ("ep_backend", EP_BACKENDS),
            ("moe_backend", MOE_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.sp == "on":
            if self.pipeline_parallel_size > 1:
                raise ValueError(
                    f"sequence-parallel MoE is not supported with pipeline parallelism "
                    f"(pipeline_parallel_size={self.pipeline_parallel_size}); use sp='off'"
                )
            if self.tensor_parallel_size == 1:
                raise ValueError(
                    "sp='on' needs tensor_parallel_size > 1, got 1: "
                    "with one TP rank there is nothing to shard the tokens over"
                )
            if not self.enable_expert_parallel:
                raise ValueError(
                    "sp='on' needs enable_expert_parallel=True: each rank "
                    "routes only its own token shard, so every expert must be whole on some rank"
                )
        if self.simulated_load not in ("rank0", "busiest"):
            raise ValueError(
                f"simulated_load must be 'rank0' or 'busiest', got {self.simulated_load!r}"
            )
        if self.simulate_rank and self.ep_backend != "allgather_reducescatter":
            raise ValueError(
                "the simulated rank fills the all-gather dispatch's blocks only; ep_backend must "
                f"be 'allgather_reducescatter', got {self.ep_backend!r}"
            )
        if self.simulated_load != "rank0" and not self.simulate_rank:
            raise ValueError(
                f"simulated_load={self.simulated_load!r} needs simulate_rank=True (a real run has "
                f"every rank's own load)"
            )
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                f"pipeline parallelism is not implemented (pipeline_parallel_size="
                f"{self.pipeline_parallel_size}); expected 1"
            )
        if not self.enable_expert_parallel and self.world_size > 1:
            raise ValueError(
                "enable_expert_parallel=False (TP-sharded experts) is not implemented; with "
                f"{self.world_size} ranks the routed experts are split over the EP "
                "group, so pass True"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def seeded_routing(self) -> int | None:
        """The seed of the routers' seeded top-k, or None: the model's own gates route."""
        if self.routing_seed is None and self.simulate_rank:
            return 0
        return self.routing_seed

    @property
    def use_sequence_parallel_moe(self) -> bool:
        """Whether the MoE layers run sequence-parallel (and with `sp_scope="all"`, every layer).

        `auto` follows the upstream rule (vLLM #48849): SP only when attention is both data- and
        tensor-parallel with experts spread over DP x TP, because at DP=1 SP measured up to 19%
        slower at one request.
        """
        if self.sp == "on":
            return True
        if self.sp == "off":
            return False
        return (
            self.tensor_parallel_size > 1
            and self.data_parallel_size > 1
            and self.enable_expert_parallel
            and self.pipeline_parallel_size == 1
        )
