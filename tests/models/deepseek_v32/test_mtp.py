"""The MTP layer against a plain single-rank formulation written here (transformers' decoder layer as the
block, the rest in a few lines of torch), for TP 1-4 with SP off / on; its collectives; its weight errors.

There is no transformers oracle for MTP: transformers does not implement it. The formulation below follows
the DeepSeek-V3 / GLM definition: x = eh_proj([enorm(embed(next token)), zero at position 0 | hnorm(h)]),
the block, then shared_head.norm and the head.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from spmoe.config import ParallelConfig
from spmoe.distributed import count_collectives, get_parallel_state, spawn

from .conftest import MTP_MAIN_LAYERS

TOLERANCE = 1e-4  # relative to the largest |logit|
SP_MODES = [("off", "moe"), ("on", "moe"), ("on", "all")]
# Each batch: sequences of S + 1 tokens; the target runs on the first S, MTP gets tokens 1..S. N = sum of S.
SEQ_LENS = [[1], [2], [3], [5], [4, 1], [1, 1]]


def hf_layers(hf, layers, hidden, positions):
    """transformers decoder layers over one sequence: hidden `[S, H]` -> `[S, H]`."""
    mask = torch.full((len(positions), len(positions)), torch.finfo(torch.float32).min).triu(1)[
        None, None
    ]
    position_ids = positions[None]
    rotary = hf.model.rotary_emb(hidden[None], position_ids=position_ids)
    h, topk = hidden[None], None
    for layer in layers:
        h, topk = layer(
            h,
            attention_mask=mask,
            position_embeddings=rotary,
            position_ids=position_ids,
            prev_topk_indices=topk,
        )
    return h[0]


def rms_norm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference(hf, weights, tokens, own):
    """-> (target post-norm hidden `[S, H]`, MTP logits `[S, V]`) for one sequence of S + 1 tokens."""
    prefix, eps = f"model.layers.{MTP_MAIN_LAYERS}", hf.config.rms_norm_eps
    ids, positions = torch.tensor(tokens), torch.arange(len(tokens) - 1)
    main = hf.model.layers[:MTP_MAIN_LAYERS]
    target = hf.model.norm(hf_layers(hf, main, hf.model.embed_tokens(ids[:-1]), positions))
    table = weights[f"{prefix}.embed_tokens.weight"] if own else hf.model.embed_tokens.weight
    embeds = table[ids[1:]].masked_fill((positions == 0)[:, None], 0.0)
    x = F.linear(
        torch.cat(
            [
                rms_norm(embeds, weights[f"{prefix}.enorm.weight"], eps),
                rms_norm(target, weights[f"{prefix}.hnorm.weight"], eps),
            ],
            -1,
        ),
        weights[f"{prefix}.eh_proj.weight"],
    )
    out = hf_layers(hf, [hf.model.layers[MTP_MAIN_LAYERS]], x, positions)
    hidden = rms_norm(out, weights[f"{prefix}.shared_head.norm.weight"], eps)
    head = weights[f"{prefix}.shared_head.head.weight"] if own else hf.lm_head.weight
    return target, F.linear(hidden, head)


def run_mtp(cases, batches):
    """cases: [(folder, sp, scope)]; batches: [(next ids [N], positions [N], target hidden [N, H], lens)] ->
    per case, per batch: (logits, rank 0's collective counts)."""
    from spmoe.models.deepseek_v32.weights import load_model

    state, results = get_parallel_state(), []
    for folder, sp, scope in cases:
        parallel = ParallelConfig(tensor_parallel_size=state.tp_size, sp=sp, sp_scope=scope)
        mtp = load_model(folder, parallel, with_mtp=True).mtp[0]
        per_batch = []
        for ids, positions, hidden, lens in batches:
            with torch.no_grad(), count_collectives() as counted:
                logits = mtp.logits(mtp(ids, positions, hidden, lens))
            per_batch.append((logits, {k: v["count"] for k, v in counted.as_dict().items()}))
        results.append((mtp.use_sequence_parallel_moe, per_batch))
    return results


def expected_counts(sp: bool, t: int) -> dict:
    """One MTP step and its logits, from the layout contract."""
    if t == 1:
        return dict(all_reduce=0, all_gather=0, reduce_scatter=0, all_to_all=0)
    if sp:  # embedding RS; block: gather input, RS attention, dispatch AG + combine RS; exit AG; head AG
        return dict(all_reduce=0, all_gather=4, reduce_scatter=3, all_to_all=0)
    # embedding AR, attention output AR, exit AR (each partial reduced once); head AG
    return dict(all_reduce=3, all_gather=1, reduce_scatter=0, all_to_all=0)


@pytest.fixture(scope="module")
def mtp_cases(mtp_checkpoints):
    """Batches and their reference logits for both checkpoints."""
    hf, weights, folders = mtp_checkpoints
    gen = torch.Generator().manual_seed(11)
    batches, want = [], {"own": [], "shared": []}
    with torch.no_grad():
        for lens in SEQ_LENS:
            seqs = [
                torch.randint(0, hf.config.vocab_size, (s + 1,), generator=gen).tolist()
                for s in lens
            ]
            for name in want:
                want[name].append(
                    torch.cat([reference(hf, weights, seq, name == "own")[1] for seq in seqs])
                )
            targets = torch.cat([reference(hf, weights, seq, False)[0] for seq in seqs])
            batches.append(
                (
                    torch.tensor([t for seq in seqs for t in seq[1:]]),
                    torch.cat([torch.arange(s) for s in lens]),
                    targets,
                    lens,
                )
            )
    return folders, batches, want


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_mtp_matches_reference(tp, mtp_cases):
    folders, batches, want = mtp_cases
    modes = SP_MODES if tp > 1 else [("off", "moe")]
    cases = [(name, sp, scope) for name in folders for sp, scope in modes]
    results = spawn(
        run_mtp, tp, [(folders[name], sp, scope) for name, sp, scope in cases], batches
    )[0]
    worst = 0.0
    for (name, sp, scope), (is_sp, per_batch) in zip(cases, results):
        assert is_sp == (sp == "on")
        for lens, (got, counted), expected in zip(SEQ_LENS, per_batch, want[name]):
            err = ((got - expected).abs().max() / expected.abs().max()).item()
            worst = max(worst, err)
            assert err < TOLERANCE, f"{name} tp={tp} sp={sp}/{scope} lens={lens}: rel err {err:.2e}"
            assert counted == expected_counts(is_sp, tp), (name, sp, scope, lens)
    print(
        f"tp={tp}: {len(cases)} configurations x {len(batches)} batches, worst rel err {worst:.2e}"
    )


def try_load(folders):
    from spmoe.models.deepseek_v32.weights import load_model

    errors = []
    for folder in folders:
        try:
            load_model(folder, ParallelConfig(tensor_parallel_size=1), with_mtp=True)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_mtp_weight_errors(mtp_checkpoints, tmp_path):
    folder = mtp_checkpoints[2]["shared"]
    prefix = f"model.layers.{MTP_MAIN_LAYERS}"
    tensors = load_file(f"{folder}/model.safetensors")
    variants = {
        "missing": {k: v for k, v in tensors.items() if k != f"{prefix}.hnorm.weight"},
        "unexpected": {**tensors, f"{prefix}.shared_head.bias": torch.zeros(3)},
        "no_mtp": {k: v for k, v in tensors.items() if not k.startswith(f"{prefix}.")},
    }
    folders = []
    for name, variant in variants.items():
        (tmp_path / name).mkdir()
        save_file(variant, tmp_path / name / "model.safetensors")
        shutil.copy(f"{folder}/config.json", tmp_path / name / "config.json")
        folders.append(str(tmp_path / name))
    config = json.loads((tmp_path / "no_mtp" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "no_mtp" / "config.json").write_text(json.dumps(config))
    missing, unexpected, no_mtp = spawn(try_load, 1, folders)[0]
    assert (
        missing
        == f"checkpoint {tmp_path / 'missing'} is missing 1 tensor(s), first: {prefix}.hnorm.weight"
    )
    assert (
        unexpected
        == f"checkpoint {tmp_path / 'unexpected'} has an unexpected tensor: {prefix}.shared_head.bias"
    )
    assert no_mtp == "the checkpoint has no MTP layer (num_nextn_predict_layers is 0 or missing)"
