"""The expert-backend selection matrix: device and capability (simulated), the installed libraries (Triton,
FlashInfer; set both ways, never read from this machine), dtype and FP8 scheme, SP, EPLB, dispatch backend, and
explicit requests. Pure rules: no GPU and no process group needed; the same matrix on every machine."""

import importlib
import itertools

import pytest
import torch

from spmoe.config import ModelConfig, ParallelConfig
from spmoe.layers.moe.experts.base import ExpertsDeployment
from spmoe.layers.moe.experts.selection import select_experts
from spmoe.layers.moe.experts.trtllm import TrtLlmFp8ExpertsBase, TrtLlmFp8ExpertsModular
from tests.engine.conftest import ENGINE_CONFIG

HOPPER, BLACKWELL = (9, 0), (10, 0)


def deployment(
    device="cuda",
    capability=HOPPER,
    dtype=torch.bfloat16,
    fp8_block=(128, 128),
    sp=False,
    eplb=False,
    ep_backend="allgather_reducescatter",
    flashinfer=True,
    hidden=6144,
    inter=2048,
    dp=1,
    triton=True,
):
    return ExpertsDeployment(
        device=device,
        capability=capability if device == "cuda" else None,
        dtype=dtype,
        fp8_block=fp8_block,
        hidden_size=hidden,
        intermediate_size=inter,
        num_experts=256,
        use_sequence_parallel_moe=sp,
        ep_backend=ep_backend,
        triton=triton,
        flashinfer=flashinfer,
        data_parallel_size=dp,
        enable_eplb=eplb,
    )


def expected(d: ExpertsDeployment) -> str:
    """The rule, restated independently of the code: TRT-LLM needs Blackwell + FlashInfer + FP8 block-128
    in bf16 and no EPLB; the monolithic kernel also needs SP off and DP = 1; both need all-gather /
    reduce-scatter."""
    trtllm = (
        d.device == "cuda"
        and d.capability[0] == 10
        and d.flashinfer
        and d.fp8_block == (128, 128)
        and d.dtype == torch.bfloat16
        and not d.enable_eplb
        and d.ep_backend == "allgather_reducescatter"
    )
    if trtllm and not d.use_sequence_parallel_moe and d.data_parallel_size == 1:
        return "flashinfer_trtllm_monolithic"
    if trtllm:
        return "flashinfer_trtllm_modular"
    triton = (
        d.device == "cuda"
        and d.triton
        and d.dtype in (torch.bfloat16, torch.float16)
        and d.fp8_block in (None, (128, 128))
        and d.capability >= ((8, 9) if d.fp8_block else (8, 0))
    )
    return "triton" if triton else "torch"


MATRIX = list(
    itertools.product(
        [("cpu", None), ("cuda", (8, 0)), ("cuda", HOPPER), ("cuda", BLACKWELL)],
        [torch.float32, torch.bfloat16],
        [None, (128, 128), (64, 64)],
        [False, True],  # SP
        [False, True],  # EPLB
        ["allgather_reducescatter", "all_to_all"],
        [False, True],  # FlashInfer installed
        [1, 2],  # DP size
        [False, True],  # Triton installed
    )
)


def test_auto_selection_matrix():
    chosen = {}
    for (device, cap), dtype, block, sp, eplb, backend, fi, dp, triton in MATRIX:
        d = deployment(device, cap, dtype, block, sp, eplb, backend, fi, dp=dp, triton=triton)
        name = select_experts(d).name
        assert name == expected(d), d
        chosen[name] = chosen.get(name, 0) + 1
        if sp:  # never the kernel that routes inside, and always one that takes our routing (pad rows masked)
            assert (
                name != "flashinfer_trtllm_monolithic" and not select_experts(d).routes_internally
            )
        if eplb:
            assert not name.startswith("flashinfer_trtllm")
    assert set(chosen) == {
        "torch",
        "triton",
        "flashinfer_trtllm_monolithic",
        "flashinfer_trtllm_modular",
    }


def test_sequence_parallel_on_blackwell_picks_the_modular_trtllm_kernel():
    assert (
        select_experts(deployment(capability=BLACKWELL, sp=False)).name
        == "flashinfer_trtllm_monolithic"
    )
    assert (
        select_experts(deployment(capability=BLACKWELL, sp=True)).name
        == "flashinfer_trtllm_modular"
    )
    assert (
        select_experts(deployment(capability=BLACKWELL, sp=True), "flashinfer_trtllm").name
        == "flashinfer_trtllm_modular"
    )


def test_supports_parallel_config():
    for sp, eplb, dp in itertools.product([False, True], [False, True], [1, 2]):
        d = deployment(capability=BLACKWELL, sp=sp, eplb=eplb, dp=dp)
        assert TrtLlmFp8ExpertsBase._supports_parallel_config(d) == (
            not sp and not eplb and dp == 1
        )
        assert TrtLlmFp8ExpertsModular._supports_parallel_config(d) == (not eplb)


@pytest.mark.parametrize(
    "requested, d, fragment",
    [
        ("triton", deployment(device="cpu"), "triton: needs a CUDA device, got cpu"),
        ("triton", deployment(triton=False), "triton: triton is not installed"),
        (
            "triton",
            deployment(dtype=torch.float32),
            "triton: computes in bfloat16 / float16, got torch.float32",
        ),
        (
            "triton",
            deployment(fp8_block=(64, 64)),
            "triton: FP8 weights need 128 x 128 blocks, got (64, 64)",
        ),
        (
            "triton",
            deployment(capability=(8, 0)),
            "needs compute capability >= (8, 9) for FP8, got (8, 0)",
        ),
        (
            "triton",
            deployment(hidden=48),
            "hidden size 48 and expert intermediate size 2048 must be multiples of 128",
        ),
        (
            "flashinfer_trtllm",
            deployment(capability=HOPPER),
            "flashinfer_trtllm_monolithic: needs a Blackwell SM100-family GPU, got cuda with capability (9, 0); "
            "flashinfer_trtllm_modular: needs a Blackwell SM100-family GPU",
        ),
        (
            "flashinfer_trtllm",
            deployment(capability=BLACKWELL, flashinfer=False),
            "FlashInfer is not installed",
        ),
        ("flashinfer_trtllm", deployment(capability=BLACKWELL, eplb=True), "EPLB: True"),
        (
            "flashinfer_trtllm",
            deployment(capability=BLACKWELL, fp8_block=None),
            "needs FP8 weights with 128 x 128 blocks",
        ),
    ],
)
def test_explicit_request_that_does_not_fit_says_why(requested, d, fragment):
    with pytest.raises(
        ValueError, match=f"moe_backend {requested!r} does not fit this deployment: "
    ) as err:
        select_experts(d, requested)
    assert fragment in str(err.value)


def test_explicit_requests_that_fit():
    assert select_experts(deployment(device="cpu", dtype=torch.float32), "torch").name == "torch"
    assert select_experts(deployment(capability=BLACKWELL), "triton").name == "triton"
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        select_experts(deployment(), "cutlass")


def test_triton_missing_falls_back_to_torch_on_a_gpu():
    assert select_experts(deployment(capability=HOPPER, triton=False)).name == "torch"
    assert select_experts(deployment(capability=HOPPER, triton=True)).name == "triton"


def importable(package: str) -> bool:
    try:
        importlib.import_module(package)
        return True
    except ImportError:
        return False


def test_the_process_probes_its_installed_libraries(tmp_path, monkeypatch):
    """`for_layer`, which the model uses, reports what this process can import: here as a real import finds it,
    and True for both once a package of that name is on the path."""
    cfg = ModelConfig.from_dict(ENGINE_CONFIG)

    def probe() -> tuple[bool, bool]:
        d = ExpertsDeployment.for_layer(cfg, ParallelConfig(), False, torch.float32, "cpu")
        return d.triton, d.flashinfer

    assert probe() == (importable("triton"), importable("flashinfer"))
    for package in ("triton", "flashinfer"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert probe() == (True, True)
