"""benchmarks/project_node.py on synthetic inputs: every projected figure checked against the arithmetic of its
rule, worked out here by hand (docs/deployment-sizing.md states the rules)."""

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import project_node  # noqa: E402

sys.path.pop(0)

TABLE = {
    "world": 8,
    "one_shot_us": {"value": [8, 12]},
    "nccl_in_graph_us": {"value": [10, 20]},
    "nccl_bus_bandwidth_gbs": {"value": 100},
    "published_by_size": {"bytes": [1e6, 2e6], "one_shot_us": [20, 30], "nccl_us": [30, 40]},
    "standin_launch_us": {"value": 2.0},
    "hbm_bandwidth_gbs": {"value": 1000},
    "host_us_per_step": {"value": {"dp1": 0, "dp": None}},
    "mtp_acceptance_length": {"value": {"3": 3.0}},
    "workload": {
        "input_tokens": 8192,
        "output_tokens": 1024,
        "concurrency": [1, 16, 64],
        "gpus": 8,
    },
    "peers": {"source": "test", "rows": [{"who": "peer", "concurrency": 1, "tok_s_node": 80.0}]},
}
SMALL = [{"kind": "all_reduce", "path": "one_shot", "count": 100, "bytes": 100 * 12288}]
FILL = {"tokens": 8192, "ms": 100.0}
FILL["collectives"] = [{"kind": "all_gather", "path": "nccl", "count": 10, "bytes": 10 * 4_000_000}]


def case(batch, k, step_ms, collectives=SMALL):
    return {
        "batch": batch,
        "context": 8192,
        "mtp_k": k,
        "step_ms": step_ms,
        "collectives": collectives,
    }


def raw(dp=1, capacity=10**7, layers=(78,), steps=((3.0, 6.0),)):
    records = [
        {
            "layers": depth,
            "kv": {"rank_tokens_full_depth": capacity},
            "decode": [case(1, 0, one), case(16, 0, sixteen), case(1, 3, 2 * one)],
            "prefill": [FILL],
        }
        for depth, (one, sixteen) in zip(layers, steps)
    ]
    return {
        "tp": 8 // dp,
        "dp": dp,
        "sp": "off",
        "load": "busiest",
        "full_layers": 78,
        "records": records,
        "_path": "synthetic",
    }


def rows_of(raws, **where):
    rows = project_node.project(raws, copy.deepcopy(TABLE))
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def test_tp8_batch_1_step_tpot_and_throughput_follow_the_rules():
    (opt,) = rows_of([raw()], concurrency=1, mtp_k=0, column="optimistic")
    (pes,) = rows_of([raw()], concurrency=1, mtp_k=0, column="pessimistic")
    one_shot_us = 8 + (20 - 8) * 12288 / 1e6  # linear from 8 us at 0 bytes to 20 us at 1 MB
    assert opt["node_step_ms"] == pytest.approx(3.0 + 100 * one_shot_us / 1e3)
    nccl_us = 20 + (30 - 20) * 12288 / 1e6  # pessimistic: NCCL's curve from the measured 20 us
    assert pes["node_step_ms"] == pytest.approx(3.0 + 100 * nccl_us / 1e3)
    # prefill: 10 all-gathers of 4 MB: NCCL's table extended by its last slope (60 us, above the 35 us of
    # wire time); minus 10 fill copies of 2 us + 2 x 4 MB at 1000 GB/s
    fill_ms = 100.0 - (10 * 2 + 10 * 2 * 4e6 / 1e6) / 1e3 + 10 * 60 / 1e3
    assert opt["prefill_ms"] == pytest.approx(fill_ms)
    lifetime_s = (1024 * opt["node_step_ms"] + fill_ms) / 1e3
    assert opt["tok_s_per_gpu"] == pytest.approx(1024 / lifetime_s / 8)
    assert opt["tpot_ms"] == opt["node_step_ms"]


def test_mtp_divides_the_step_by_the_acceptance_length():
    (row,) = rows_of([raw()], concurrency=1, mtp_k=3, column="optimistic")
    one_shot_us = 8 + (20 - 8) * 12288 / 1e6
    assert row["tpot_ms"] == pytest.approx((6.0 + 100 * one_shot_us / 1e3) / 3.0)


def test_unmeasured_batches_kv_misfits_and_unmeasured_host_work_are_reported_not_guessed():
    (row,) = rows_of([raw()], concurrency=64, mtp_k=0, column="optimistic")
    assert row["result"].startswith("not measured")  # batch 64 is past the measured 1 and 16
    (small,) = rows_of([raw(capacity=16 * 9216 - 1)], concurrency=16, mtp_k=0, column="optimistic")
    assert small["result"] == "does not fit the KV cache"
    (dp,) = rows_of([raw(dp=8)], concurrency=64, mtp_k=0, column="optimistic")
    assert dp["batch_per_rank"] == 8 and dp["result"] == "host work per step not measured"


def test_batches_between_measured_ones_interpolate_and_depth_extrapolates_from_two():
    table = copy.deepcopy(TABLE)
    table["workload"]["concurrency"] = [7]
    rows = project_node.project([raw()], table)
    seven = [r for r in rows if r["mtp_k"] == 0 and r["column"] == "optimistic"][0]
    (one,) = rows_of([raw()], concurrency=1, mtp_k=0, column="optimistic")
    (sixteen,) = rows_of([raw()], concurrency=16, mtp_k=0, column="optimistic")
    assert seven["node_step_ms"] == pytest.approx(
        one["node_step_ms"] + (sixteen["node_step_ms"] - one["node_step_ms"]) * 6 / 15
    )
    deep = raw(layers=(4, 8), steps=((1.0, 2.0), (2.0, 4.0)))
    (row,) = rows_of([deep], concurrency=1, mtp_k=0, column="pessimistic")
    assert "extrapolated to 78 layers from 4 and 8" in row["depth"]
    nccl_us = 20 + (30 - 20) * 12288 / 1e6
    assert row["node_step_ms"] == pytest.approx(1.0 + 1.0 * 74 / 4 + 100 * nccl_us / 1e3)


def test_a_single_shallow_depth_is_an_error_and_the_report_names_the_best_layout():
    with pytest.raises(ValueError, match="needs it measured, or two depths"):
        project_node.project([raw(layers=(4,))], copy.deepcopy(TABLE))
    text = project_node.render(project_node.project([raw()], copy.deepcopy(TABLE)), TABLE)
    assert "| peer | 1 | 10.0 | - |" in text and "- 1 concurrent, optimistic: tp8 x dp1" in text
