"""The simulated rank's stand-in routing in Triton (`moe.seeded_triton`) against the torch reference
it replaces (`simulated.seeded_routing`, then `simulated.rotate_to_busiest` on the busiest load):
the same ids and weights, bit for bit, for 256 and 64 experts, top-8, EP 8, 1 to 300 rows (one
program and several), blocks with pad rows and empty blocks, seeds and layers near 0 and large, the
busiest rotation off and on (the cases include rotations by a nonzero shift). On CUDA at the node's
decode and prefill sizes too (up to 65536 rows: an 8192-token prompt, SP off). On CUDA, where `MoE`
routes with it; on the CPU too under Triton's interpreter (`TRITON_INTERPRET=1` with triton
installed, which CPU CI is not)."""

import pytest
import torch

from spmoe.distributed.simulated import (
    MIX,
    _mix,
    block_tokens,
    rotate_to_busiest,
    seeded_routing,
)

from ..multigpu import kernel_devices, requires_gpus

DEVICES = kernel_devices()
EP = 8
# (block_tokens' tokens, sharded, tp_size, ep_size, dp_rank), rows a block
CASES = [
    ((1, False, 8, EP, 0), 1),  # TP 8, batch 1, SP off: 8 blocks of the one token
    ((1, False, 1, 1, 0), 1),  # no dispatch: one block of one row
    ((3, False, 8, EP, 0), 3),
    ((13, True, 4, EP, 0), 4),  # DP 2 x TP 4, SP: shards of 4 rows, the last 1 row
    ((20, True, 8, EP, 0), 3),  # TP 8, SP: shards of 3 rows, the seventh 2, the last empty
    ((300, True, 8, EP, 1), 38),  # 304 rows: several programs
    ((271, False, 1, 1, 2**20), 300),  # one block, tokens from 2**44, 29 pad rows
]
SEEDS = [(0, 3), (12345, 0), (2**62 + 1, 77)]


def reference(seed, layer, blocks, rows, experts, busiest):
    starts, valid = block_tokens(*blocks, "cpu")
    ids, weights = seeded_routing(seed, layer, starts, valid, rows, experts, 8, 2.5)
    if busiest:
        ids = rotate_to_busiest(ids, EP, experts)
    return ids, weights


def check_equal(device: str, cases: list, experts: int) -> int:
    """The kernel against the reference (on the CPU) in every case, seed and load -> how many
    busiest cases rotated by a nonzero shift."""
    from spmoe.layers.moe.seeded_triton import seeded_routing as fused

    shifted = 0
    for blocks, rows in cases:
        for (seed, layer), busiest in zip(SEEDS * 2, [False] * 3 + [True] * 3, strict=True):
            want_ids, want_weights = reference(seed, layer, blocks, rows, experts, busiest)
            ids, weights = fused(
                seed, layer, blocks, rows, experts, 8, 2.5, device, EP if busiest else None
            )
            where = (blocks, rows, seed, layer, busiest)
            assert ids.device.type == device and weights.device.type == device, where
            assert ids.dtype == torch.int64 and weights.dtype == torch.float32, where
            assert torch.equal(ids.cpu(), want_ids), where
            assert torch.equal(weights.cpu(), want_weights), where
            if busiest:
                plain = reference(seed, layer, blocks, rows, experts, False)[0]
                shifted += not torch.equal(plain, want_ids)
    return shifted


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [256, 64])
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_routes_as_the_reference(device, experts):
    assert check_equal(device, CASES, experts) >= 3  # the rotation really moved ids


@pytest.mark.gpu
@requires_gpus(1)
@pytest.mark.parametrize(
    "tokens, sharded", [(256, False), (1024, False), (8192, True), (8192, False)]
)
def test_kernel_routes_as_the_reference_at_the_node_sizes(tokens, sharded):
    # decode at batch 256 (MTP 0 and 3, SP off: 8 blocks of every token) and an 8192-token prompt
    # (SP on: shards of 1024 rows; off: 8 blocks of 8192); the reference on CUDA too
    blocks, rows = (tokens, sharded, 8, EP, 0), tokens // 8 if sharded else tokens
    assert check_equal("cuda", [(blocks, rows)], 256) >= 1
    starts, valid = block_tokens(*blocks, "cuda")
    on_cuda = rotate_to_busiest(seeded_routing(0, 3, starts, valid, rows, 256, 8, 2.5)[0], EP, 256)
    assert torch.equal(on_cuda.cpu(), reference(0, 3, blocks, rows, 256, True)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_refuses_what_it_cannot_route(device):
    from spmoe.layers.moe.seeded_triton import seeded_routing as fused

    with pytest.raises(ValueError, match="k of 64 experts, got k=65"):
        fused(0, 0, (1, False, 1, 1, 0), 1, 64, 65, 1.0, device)
    with pytest.raises(ValueError, match="EP ranks dividing 64, got 6"):
        fused(0, 0, (1, False, 1, 1, 0), 1, 64, 8, 1.0, device, 6)
    with pytest.raises(
        ValueError, match=r"tp_size, ep_size >= 1, got blocks \(1, False, 0, 1, 0\)"
    ):
        fused(0, 0, (1, False, 0, 1, 0), 1, 64, 8, 1.0, device)


def test_a_rows_expert_scores_are_distinct_so_the_top_k_has_no_ties():
    # what lets the kernel's top-k match torch.topk's order without a tie rule: the hash is a
    # bijection and one row's keys differ, so 4096 rows x 256 experts give 256 distinct scores a row
    key = _mix(_mix(torch.arange(4096, dtype=torch.int64) * MIX[0] + 7) + 3)
    scores = _mix(key[:, None] + torch.arange(256, dtype=torch.int64) * MIX[2])
    assert all(len(set(row)) == 256 for row in scores.tolist())
