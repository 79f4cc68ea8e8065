"""Our logits against transformers' for TP 1-4, SP off / on (scopes moe and all), both model types, FP8.

One spawned group per TP size runs every (checkpoint, SP mode, batch) case and returns logits and rank 0's
collective counts; the comparisons happen here.
"""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.entrypoints.jobs import flatten
from spmoe.models.deepseek_v32.decoder_layer import DeepseekV32DecoderLayer

from .conftest import MODELS, relative_error

TOLERANCE = 1e-4  # relative to the largest |logit|
SP_MODES = [
    ("off", "moe", "allgather_reducescatter"),
    ("on", "moe", "allgather_reducescatter"),
    ("on", "all", "allgather_reducescatter"),
    ("on", "moe", "all_to_all"),
]


def run_cases(cases):
    """cases: [(folder, sp, scope, ep_backend, batches)] -> [(per-batch logits, per-batch stats, SP flags per
    layer)]."""
    from spmoe.models.deepseek_v32.weights import load_model

    state = get_parallel_state()
    results = []
    for folder, sp, scope, ep_backend, batches in cases:
        parallel = ParallelConfig(
            tensor_parallel_size=state.tp_size, sp=sp, sp_scope=scope, ep_backend=ep_backend
        )
        model = load_model(folder, parallel)
        logits, stats = [], []
        for seqs in batches:
            with torch.no_grad(), count_collectives() as counted:
                logits.append(model(*flatten(seqs, "cpu")))
            stats.append(counted.as_dict())
        flags = [
            m.use_sequence_parallel_moe
            for m in model.modules()
            if isinstance(m, DeepseekV32DecoderLayer)
        ]
        results.append((logits, stats, flags))
    return results


def expected_counts(mlp_types, sp_flags, t, ep_backend="allgather_reducescatter"):
    """Collectives of one forward, derived from the layer pattern alone (the layout contract)."""
    counts = dict.fromkeys(("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), 0)
    if t == 1:
        return counts
    previous = None
    for kind, sp in zip(mlp_types, sp_flags):
        if previous is None:
            # embedding partial: RS into shards, or AR
            counts["reduce_scatter" if sp else "all_reduce"] += 1
        elif previous and not sp:
            counts["all_gather"] += 1  # _all_gather_sp_states: the sharded region ends
        elif not previous:
            counts["all_reduce"] += 1  # PARTIAL input: reduce + add-norm
        if sp:
            counts["all_gather"] += previous is not False  # SHARDED input: gather the normed hidden
            counts["reduce_scatter"] += 1  # after attention
            if kind == "sparse" and ep_backend == "all_to_all":
                counts["all_to_all"] += 3  # row counts, rows with routing, partial outputs back
            elif kind == "sparse":
                counts["all_gather"] += 1  # dispatch: hidden with its routing
                counts["reduce_scatter"] += 1  # combine
        else:
            counts["all_reduce"] += 1  # after attention
        previous = sp
    counts["all_gather" if sp_flags[-1] else "all_reduce"] += 1  # model exit
    counts["all_gather"] += 1  # vocab-parallel LM head
    return counts


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_logits_match_transformers(tp, checkpoints):
    names = ["glm", "dsv32"] + (["glm_fp8"] if tp == 2 else [])
    modes = SP_MODES if tp > 1 else SP_MODES[:1]
    cases = [(name, *mode) for name in names for mode in modes]
    results = spawn(
        run_cases,
        tp,
        [(checkpoints[n][0], sp, scope, ep, checkpoints[n][1]) for n, sp, scope, ep in cases],
    )[0]
    worst = 0.0
    for (name, sp, scope, ep), (logits, stats, flags) in zip(cases, results):
        mlp_types = MODELS[name.removesuffix("_fp8")][2]["mlp_layer_types"]
        assert flags == [sp == "on" and (kind == "sparse" or scope == "all") for kind in mlp_types]
        for seqs, got, want, counted in zip(
            checkpoints[name][1], logits, checkpoints[name][2], stats
        ):
            err = relative_error(got, want)
            worst = max(worst, err)
            assert got.shape == want.shape
            lens = list(map(len, seqs))
            assert err < TOLERANCE, (
                f"{name} tp={tp} sp={sp}/{scope}/{ep} lens={lens}: rel err {err:.2e}"
            )
            assert {k: v["count"] for k, v in counted.items()} == expected_counts(
                mlp_types, flags, tp, ep
            ), (
                name,
                sp,
                scope,
                ep,
                [len(s) for s in seqs],
            )
            if sp == "on" and scope == "all":
                assert counted["all_reduce"]["count"] == 0
            if sp == "off" and tp > 1:
                assert (
                    counted["reduce_scatter"]["count"] == 0 and counted["all_reduce"]["count"] > 0
                )
    rows = [
        (int((~torch.isnan(want).any(-1)).sum()), want.shape[0])
        for n in names
        for want in checkpoints[n][2]
    ]
    print(
        f"tp={tp}: {len(cases)} configurations x {len(checkpoints['glm'][1])} batches, worst rel err {worst:.2e}; "
        f"rows compared {sum(r[0] for r in rows)} of {sum(r[1] for r in rows)} (the rest follow a tied DSA top-k)"
    )
