"""A model config whose router cannot pick its experts is a one-line error naming the fields."""

import pytest

from spmoe.config import ModelConfig
from tests.engine.conftest import ENGINE_CONFIG


@pytest.mark.parametrize(
    "router, message",
    [
        (
            dict(n_routed_experts=12, n_group=5),
            "router groups do not fit: n_routed_experts=12, n_group=5",
        ),
        (dict(n_routed_experts=12, n_group=4, topk_group=6), "router groups do not fit"),
        (
            dict(n_routed_experts=4, num_experts_per_tok=8),
            "num_experts_per_tok=8 is more than the 4 experts",
        ),
        (
            dict(n_routed_experts=12, n_group=4, topk_group=1, num_experts_per_tok=4),
            "num_experts_per_tok=4 is more than the 3 experts a token's 1 of 4 router groups hold",
        ),
    ],
)
def test_a_router_that_cannot_pick_its_experts_is_refused(router, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**ENGINE_CONFIG, **router})


def test_a_router_that_fits_exactly_is_taken():
    cfg = ModelConfig.from_dict(
        {
            **ENGINE_CONFIG,
            "n_routed_experts": 12,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 6,
        }
    )
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (12, 6)
