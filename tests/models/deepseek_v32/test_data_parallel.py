"""Data-parallel attention with experts over DP x TP, on 4 gloo processes: TP2 x DP2 (SP off, on, on for
every layer) and TP1 x DP4 against the transformers oracle; uneven batches (the sequences of a batch go to
DP ranks in turn, so DP ranks get 24 and 4 tokens, 9 and 2, or nothing at all); and the work counters, which
show that SP removes the t-fold duplicated expert work.

One spawned group per layout runs every case; each DP group returns its sequences' logits.
"""

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import count_collectives, get_parallel_state, spawn
from spmoe.entrypoints.jobs import flatten, split_for_dp
from spmoe.layers.moe.work import count_moe_work

from .conftest import relative_error

TOLERANCE = 1e-4  # relative to the largest |logit|
LAYOUTS = {  # (tp, dp) -> SP modes (sp, sp_scope); SP needs t > 1
    (2, 2): [("off", "moe"), ("on", "moe"), ("on", "all")],
    (1, 4): [("off", "moe")],
}


def run_dp_cases(folder: str, batches, modes):
    """-> per mode, per batch: (this DP rank's per-sequence logits, collective counts, MoE work)."""
    from spmoe.models.deepseek_v32.weights import load_model

    state, results = get_parallel_state(), []
    for sp, scope in modes:
        parallel = ParallelConfig(
            tensor_parallel_size=state.tp_size,
            data_parallel_size=state.dp_size,
            sp=sp,
            sp_scope=scope,
        )
        model = load_model(folder, parallel)
        per_batch = []
        for seqs in batches:
            ids, positions, lens = flatten(split_for_dp(seqs, state.dp_rank, state.dp_size), "cpu")
            with torch.no_grad(), count_collectives() as counted, count_moe_work() as work:
                logits = model(ids, positions, lens)
            per_batch.append(
                (
                    list(logits.split(lens)),
                    {k: v["count"] for k, v in counted.as_dict().items()},
                    work.as_dict(),
                )
            )
        results.append(per_batch)
    return state.dp_rank, state.tp_rank, results


@pytest.fixture(scope="module")
def dp_runs(checkpoints):
    """(tp, dp) -> every rank's results."""
    folder, batches, _ = checkpoints["glm"]
    return {
        (tp, dp): spawn(
            run_dp_cases,
            tp * dp,
            folder,
            batches,
            modes,
            config=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp),
        )
        for (tp, dp), modes in LAYOUTS.items()
    }


@pytest.mark.parametrize("tp, dp", sorted(LAYOUTS))
def test_matches_transformers(tp, dp, dp_runs, checkpoints):
    _, batches, oracle = checkpoints["glm"]
    ranks, worst = dp_runs[(tp, dp)], 0.0
    for m, (sp, scope) in enumerate(LAYOUTS[(tp, dp)]):
        for b, (seqs, want) in enumerate(zip(batches, oracle)):
            got = [None] * len(seqs)
            for dp_rank, tp_rank, results in ranks:
                share = results[m][b][0]
                got[dp_rank::dp] = share
                if tp_rank:  # every TP rank of a DP group holds the same logits
                    assert all(
                        torch.equal(a, c) for a, c in zip(share, ranks[dp_rank * tp][2][m][b][0])
                    )
            got = torch.cat(got)
            err = relative_error(got, want)
            worst = max(worst, err)
            assert err < TOLERANCE, (
                f"tp{tp} x dp{dp} sp={sp}/{scope} lens={list(map(len, seqs))}: {err:.2e}"
            )
            counts = ranks[0][2][m][b][1]
            if sp == "on" and scope == "all":
                # only the per-step agreement on the largest DP batch
                assert counts["all_reduce"] == 1
            if sp == "off":  # no SP reduce-scatter: only the combine of the 2 MoE layers' dispatch
                assert counts["reduce_scatter"] == 2
    print(f"tp{tp} x dp{dp}: worst rel err {worst:.2e}")


def test_sp_removes_duplicated_expert_work(dp_runs, checkpoints):
    """TP2 x DP2 (SP needs t > 1)."""
    (tp, dp), batches = (2, 2), checkpoints["glm"][1]
    ranks, off, on = dp_runs[(tp, dp)], 0, 1  # mode indices: SP off, SP on (scope moe)
    for b, seqs in enumerate(batches):
        for dp_rank, tp_rank, results in ranks:
            work_off, work_on = results[off][b][2], results[on][b][2]
            # every TP rank dispatches its DP group's tokens without SP; with SP its own shard only
            tokens = sum(map(len, split_for_dp(seqs, dp_rank, dp)))
            assert work_off["rows_dispatched"] == tokens * 2  # two MoE layers
            assert work_off["expert_rows"] == [tp * r for r in work_on["expert_rows"]], (
                b,
                dp_rank,
                tp_rank,
            )
        dispatched_on = sum(results[on][b][2]["rows_dispatched"] for *_, results in ranks)
        # each token once per MoE layer, pad rows excluded
        assert dispatched_on == sum(map(len, seqs)) * 2
