"""GLM-5.2's structure at tiny widths across 8 gloo ranks: the committed config's 78 layers (the first 3 dense,
its IndexShare pattern) with its routing, at TP 8 and at DP 2 x TP 4, SP off and on, give transformers' logits
and TP 1's; the MTP layer (dummy weights, which do not depend on the layout) drafts as at TP 1."""

import json

import pytest
import torch

from spmoe.config import ParallelConfig
from spmoe.distributed import get_parallel_state, spawn
from spmoe.entrypoints.jobs import flatten, split_for_dp

from .conftest import TP8_WIDTHS, hf_logits, make_nontrivial, relative_error
from .test_glm52_config import GLM52

TOLERANCE = 1e-4  # relative to the largest |logit|, as the other oracle tests
STRUCTURE = (
    "num_hidden_layers",
    "mlp_layer_types",
    "indexer_types",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "rms_norm_eps",
    "num_experts_per_tok",
)
SEQS = [[5, 17, 3, 90, 41, 8, 1], [60, 2, 33], [7, 7, 9, 11, 12], [4]]


def _run(folder: str, modes: list[str], draft_mode: str | None):
    """Per SP mode: this DP group's per-sequence logits, and in SP mode `draft_mode` its MTP draft logits
    (dummy weights; the token after each position is the sequence's next, its first after its last)."""
    from spmoe.models.deepseek_v32.weights import load_model

    state, out = get_parallel_state(), []
    seqs = split_for_dp(SEQS, state.dp_rank, state.dp_size)
    ids, positions, lens = flatten(seqs, "cpu")
    next_ids = torch.tensor([t for seq in seqs for t in seq[1:] + seq[:1]])
    for sp in modes:
        parallel = ParallelConfig(
            tensor_parallel_size=state.tp_size, data_parallel_size=state.dp_size, sp=sp
        )
        with torch.no_grad():
            logits = load_model(folder, parallel)(ids, positions, lens)
        if sp != draft_mode:
            out.append((list(logits.split(lens)), None))
            continue
        with torch.no_grad():
            drafter = load_model(
                folder,
                parallel,
                load_format="dummy",
                overrides={"num_nextn_predict_layers": 1},
                with_mtp=True,
            )
            hidden = drafter.forward_hidden(ids, positions, lens)
            draft = drafter.compute_draft_logits(
                drafter.forward_draft_hidden(next_ids, positions, hidden, lens)
            )
        out.append((list(logits.split(lens)), list(draft.split(lens))))
    return state.dp_rank, state.tp_rank, out


def _by_sequence(ranks, dp: int) -> list:
    """Every rank's results -> per SP mode, (logits, drafts) in SEQS order (TP rank 0 of each DP group)."""
    per_dp = {d: out for d, t, out in ranks if t == 0}
    modes = []
    for m in range(len(per_dp[0])):
        logits = [None] * len(SEQS)
        drafts = [None] * len(SEQS)
        for d, out in per_dp.items():
            order = split_for_dp(list(range(len(SEQS))), d, dp)
            for j, i in enumerate(order):
                logits[i] = out[m][0][j]
                drafts[i] = None if out[m][1] is None else out[m][1][j]
        modes.append((torch.cat(logits), None if drafts[0] is None else torch.cat(drafts)))
    return modes


@pytest.fixture(scope="module")
def glm52(tmp_path_factory):
    """A transformers GlmMoeDsa model of GLM-5.2's structure at tiny widths -> (folder, its logits)."""
    import transformers

    published = json.loads(GLM52.read_text())
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(
        transformers.GlmMoeDsaConfig(
            **TP8_WIDTHS, **{key: published[key] for key in STRUCTURE}, first_k_dense_replace=3
        )
    ).eval()
    make_nontrivial(model)
    folder = tmp_path_factory.mktemp("glm52_tiny")
    model.save_pretrained(folder)
    return str(folder), hf_logits(model, [SEQS])[0]


def test_glm52_structure_on_8_ranks_equals_transformers_and_tp_1(glm52):
    folder, oracle = glm52
    (tp1,) = _by_sequence(spawn(_run, 1, folder, ["off"], "off"), 1)
    tp8 = ParallelConfig(tensor_parallel_size=8)
    dp2 = ParallelConfig(tensor_parallel_size=4, data_parallel_size=2)
    layouts = {
        (8, 1): spawn(_run, 8, folder, ["off", "on"], "on", config=tp8),
        (4, 2): spawn(_run, 8, folder, ["off", "on"], None, config=dp2),
    }
    assert relative_error(tp1[0], oracle) < TOLERANCE
    drafted = 0
    for (tp, dp), ranks in layouts.items():
        for sp, (logits, drafts) in zip(("off", "on"), _by_sequence(ranks, dp)):
            where = f"TP {tp} x DP {dp}, SP {sp}"
            assert relative_error(logits, oracle) < TOLERANCE, where
            assert relative_error(logits, tp1[0]) < TOLERANCE, where
            if drafts is not None:
                assert relative_error(drafts, tp1[1]) < TOLERANCE, where
                drafted += 1
    assert drafted == 1  # TP 8 with SP drafted as TP 1 did
