import pytest

from spmoe.config import ParallelConfig


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(tensor_parallel_size=1, sp="on"), "tensor_parallel_size > 1"),
        (dict(tensor_parallel_size=2, pipeline_parallel_size=2, sp="on"), "pipeline parallelism"),
        (
            dict(tensor_parallel_size=2, pipeline_parallel_size=2),
            "pipeline parallelism is not implemented",
        ),
        (
            dict(tensor_parallel_size=2, sp="on", enable_expert_parallel=False),
            "enable_expert_parallel",
        ),
        (dict(tensor_parallel_size=2, enable_expert_parallel=False), "enable_expert_parallel"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
        (dict(data_parallel_size=1.5), "data_parallel_size"),
        (dict(sp="yes"), "'yes'"),
        (dict(sp_scope="dense"), "('moe', 'all')"),
        (dict(ep_backend="deepep"), "all_to_all"),
    ],
)
def test_impossible_combinations_are_rejected(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        ParallelConfig(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "tp, dp, mode, expected",
    [
        (2, 1, "on", True),
        (2, 1, "off", False),
        (1, 1, "off", False),
        (1, 4, "auto", False),
        (
            2,
            1,
            "auto",
            False,
        ),  # DP=1: upstream measured SP slower (vLLM #48656), so auto keeps it off
        (2, 2, "auto", True),
        (4, 2, "off", False),
    ],
)
def test_use_sequence_parallel_moe(tp, dp, mode, expected):
    config = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, sp=mode)
    assert config.use_sequence_parallel_moe is expected
    assert config.world_size == tp * dp
