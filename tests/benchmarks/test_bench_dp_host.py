"""benchmarks/bench_dp_host.py runs the serving loop's control plane (plan broadcast, output gather) on DP
ranks and reports a median per case."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def test_bench_dp_host_times_each_case(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))  # its rank processes import it by name
    try:
        import bench_dp_host

        medians = bench_dp_host.main(
            ["--dp", "2", "--batches", "1", "4", "--tokens", "2", "--reps", "5"]
        )
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert set(medians) == {"1x2", "4x2"} and all(us > 0 for us in medians.values())
