"""The batched sampler on a GPU at GLM-5.2's vocabulary: the same tokens as on the CPU for a batch whose rows
all have different settings (greedy, sampled, penalties, logit_bias, min_tokens, top_k / top_p / min_p), and the
same logprobs within 1e-4: the hashed noise is integer arithmetic, identical on both."""

import pytest
import torch

from spmoe.engine.request import SamplingParams
from spmoe.engine.sampling.sampler import Sampler

from ..multigpu import requires_gpus

pytestmark = pytest.mark.gpu

VOCAB = 154880
SETTINGS = [
    SamplingParams(logprobs=5),
    SamplingParams(1.0, seed=1, logprobs=5),
    SamplingParams(
        0.7, seed=2, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5
    ),
    SamplingParams(0.0, frequency_penalty=1.0, logit_bias=((7, 5.0), (9, -100.0))),
    SamplingParams(0.9, seed=4, min_tokens=3, top_k=50, top_p=0.9, min_p=0.02, logprobs=2),
]


def sample_on(device: str, logits: torch.Tensor):
    sampler = Sampler(64, VOCAB, device)
    rows = [sampler.add(SETTINGS[i % len(SETTINGS)], [1, 2, 3], stop_ids=(0, 5)) for i in range(64)]
    sampler.commit(rows * 2, list(range(10, 74)) + list(range(10, 74)))
    return sampler.sample(logits.to(device), rows, [2] * 64)


@requires_gpus(1)
def test_the_gpu_sampler_chooses_what_the_cpu_one_does():
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    cpu, gpu = sample_on("cpu", logits), sample_on("cuda", logits)
    assert gpu.token_ids == cpu.token_ids and all(gpu.finite)
    for got, want in zip(gpu.logprobs, cpu.logprobs):
        assert (got is None) == (want is None) and (got is None or abs(got - want) < 1e-4)
    for got, want in zip(gpu.top_logprobs, cpu.top_logprobs):
        assert (got is None) == (want is None)
        if got is not None:
            assert [t for t, _ in got] == [t for t, _ in want]
