"""Run a per-rank test function on GPUs: in-process under torchrun, else spawned on every local GPU."""

import os

import pytest
import torch

from spmoe.distributed import destroy_distributed, init_distributed, spawn


def requires_gpus(count: int):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(
        have < count, reason=f"needs {count} CUDA GPUs, this machine has {have}"
    )


def kernel_devices() -> list:
    """The devices a Triton kernel's test runs on: CUDA (one GPU), and the CPU under Triton's interpreter
    (triton installed and TRITON_INTERPRET=1), each skipped where it is not there."""
    from spmoe.layers.fused import TRITON_INSTALLED

    interpreted = TRITON_INSTALLED and os.environ.get("TRITON_INTERPRET") == "1"
    return [
        pytest.param("cuda", marks=requires_gpus(1)),
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(not interpreted, reason="needs triton and TRITON_INTERPRET=1"),
        ),
    ]


def run_on_gpus(fn, *args) -> list:
    """Returns this process's result under torchrun (a list of one), else every spawned rank's results."""
    if "WORLD_SIZE" in os.environ:
        init_distributed(device="cuda")
        try:
            return [fn(*args)]
        finally:
            destroy_distributed()
    return spawn(fn, torch.cuda.device_count(), *args, device="cuda")
