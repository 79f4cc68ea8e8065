"""The Triton threshold of top_k / top_p (`top_k_top_p_triton`) against the rule computed here in float64, and
against the sort path it replaces (`top_k_top_p_threshold_by_sort`), over one batch of rows at V = 1000 and at
GLM-5.2's 154880: top_k alone, top_p alone, both, ties at the k-th value and at the crossing token, -inf and the
float32 lowest value from masks, both zeros, all-equal rows, tiny top_p, top_k > V, all -inf rows, rows that
truncate nothing. On CUDA; on the CPU too under Triton's interpreter (`TRITON_INTERPRET=1` with triton
installed, which CPU CI is not)."""

import pytest
import torch

from spmoe.engine.sampling.processors import apply_top_k_top_p, top_k_top_p_threshold_by_sort

from ..multigpu import kernel_devices

pytestmark = pytest.mark.gpu

DEVICES = kernel_devices()
LOWEST = torch.finfo(torch.float32).min
# rows compared exactly: the mass above the crossing token is at least this far from top_p
MARGIN = 1e-5
TOLERANCE = 2e-6  # the kernel's float32 weights (1e-7 x (1 + |x - max|) each): the rule's kept set at a top_p
# this close, on flat rows


def reference_threshold(row: torch.Tensor, k: int, p: float) -> tuple[float, float]:
    """The rule in float64 for one row `[V]` -> (the smallest kept logit, -inf when all are kept; how far the
    mass of the tokens above the crossing one, and with it, lie from p: inf when top_p does not apply)."""
    x, vocab = row.double(), row.numel()
    kth = x.sort(descending=True).values[(k if 0 < k < vocab else vocab) - 1]
    if p >= 1 or x.max() == float("-inf"):
        return (kth.item() if 0 < k < vocab else float("-inf")), float("inf")
    kept = x[x >= kth]
    values, group = torch.unique(kept, return_inverse=True)  # ascending; -0.0 and 0.0 are one value
    mass = torch.zeros_like(values).index_add_(0, group, torch.exp(kept - x.max()))
    # the mass of the tokens >= each value, largest value first
    through = mass.flip(0).cumsum(0) / mass.sum()
    crossing = int((through < p).sum())  # the first group whose mass reaches p
    margin = through[crossing].item() - p
    if crossing:  # (the mass above the max is exactly 0: no rounding moves the first group out)
        margin = min(margin, p - through[crossing - 1].item())
    return values.flip(0)[crossing].item(), margin


def kept_count(row: torch.Tensor, threshold: float) -> int:
    return int((row >= threshold).sum())


def rows_at(vocab: int) -> list[tuple[torch.Tensor, int, float, bool]]:
    """(logits `[V]`, top_k, top_p, exact: the row's margin must be at least MARGIN) for every case."""
    gen = torch.Generator().manual_seed(vocab)
    # top_p 0.95 keeps tens to hundreds of 154880
    peaked = lambda: torch.randn(vocab, generator=gen) * 5
    # top_p 0.9 keeps most of them: margins of 1e-6 occur
    flat = lambda: torch.randn(vocab, generator=gen)
    rows = [
        (peaked(), 0, 0.95, True),
        (peaked(), 0, 0.5, True),
        (peaked(), 50, 1.0, True),
        (peaked(), 1, 1.0, True),
        (peaked(), vocab - 1, 1.0, True),
        (peaked(), vocab + 5, 1.0, True),  # k > V keeps all
        (peaked(), 50, 0.95, True),
        (peaked(), vocab // 2, 0.9, True),
        (peaked() - 100.0, 20, 0.8, True),  # all negative
        (peaked() + 100.0, 0, 0.9, True),  # all positive
        (peaked(), 0, 1e-7, True),  # keeps the max alone
        (peaked(), 0, 1.0, True),  # truncates nothing
        (flat(), 0, 0.9, False),
        (flat(), vocab // 4, 0.999, False),
    ]
    # far below the tokens placed on top
    background = lambda: torch.rand(vocab, generator=gen) * 10 - 20
    # the k-th value tied: top_k 3 over 5, 4, 4, 4, 4 keeps all five
    row = background()
    row[torch.randperm(vocab, generator=gen)[:5]] = torch.tensor([5.0, 4.0, 4.0, 4.0, 4.0])
    rows.append((row, 3, 1.0, True))
    # a tie group larger than the kernel's candidate buffer: top_k at its size and one below keep it all
    size = min(5000, vocab // 2)
    row = background()
    row[torch.randperm(vocab, generator=gen)[:size]] = 1.0
    rows += [
        (row, size, 1.0, True),
        (row.clone(), size - 1, 1.0, True),
        (row.clone(), size - 1, 0.3, True),
    ]
    # the crossing token tied: e^3 holds 0.45 of e^3 + 3 e^2 + 1, so top_p 0.5 keeps 3 and every 2
    row = background()
    row[torch.randperm(vocab, generator=gen)[:5]] = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0])
    rows.append((row, 0, 0.5, True))
    # the same with top_k 4: the 2s tie at the 4th value, all stay
    rows.append((row.clone(), 4, 0.5, True))
    # the max tied and top_p tiny: both copies of the max stay
    row = peaked()
    row[torch.randperm(vocab, generator=gen)[:2]] = row.max() + 1.0
    rows.append((row, 0, 1e-7, True))
    # both zeros at the crossing: 1.0, then twenty zeros of either sign; top_p 0.5 crosses inside them
    row = background()
    top = torch.tensor([1.0] + [0.0, -0.0] * 10)
    row[torch.randperm(vocab, generator=gen)[:21]] = top
    rows.append((row, 0, 0.5, True))
    # masks: 90% -inf (a grammar), then the float32 lowest (a grammar's mask at the dtype's lowest value)
    for fill in (float("-inf"), LOWEST):
        row = peaked()
        row[torch.randperm(vocab, generator=gen)[: vocab * 9 // 10]] = fill
        rows += [
            (row, 0, 0.9, True),
            (row.clone(), 20, 1.0, True),
            (row.clone(), vocab // 2, 0.8, True),
        ]
    # all -inf but one token, and all -inf
    row = torch.full((vocab,), float("-inf"))
    row[vocab // 3] = 2.0
    rows += [(row, 5, 0.5, True), (torch.full((vocab,), float("-inf")), 10, 0.5, True)]
    # all equal: ties keep all, whatever top_k and top_p say
    rows += [
        (torch.full((vocab,), 1.5), 10, 1.0, True),
        (torch.full((vocab,), -2.0), 10, 0.5, True),
    ]
    rows.append((torch.full((vocab,), 0.25), 0, 0.3, True))
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1000, 154880])
def test_kernel_keeps_what_the_rule_and_the_sort_keep(device, vocab):
    from spmoe.engine.sampling.top_k_top_p_triton import top_k_top_p_threshold

    rows = rows_at(vocab)
    logits = torch.stack([r for r, _, _, _ in rows]).to(device)
    top_k = torch.tensor([k for _, k, _, _ in rows], device=device)
    top_p = torch.tensor([p for _, _, p, _ in rows], dtype=torch.float32, device=device)
    got = top_k_top_p_threshold(logits, top_k, top_p).cpu()
    by_sort = top_k_top_p_threshold_by_sort(logits, top_k, top_p).cpu()
    logits = logits.cpu()
    for j, (row, k, p, exact) in enumerate(rows):
        p = top_p[j].item()  # the float32 top_p the kernel reads
        want, margin = reference_threshold(row, k, p)
        counts = dict(kernel=kept_count(row, got[j, 0].item()), rule=kept_count(row, want))
        counts["sort"] = kept_count(row, by_sort[j, 0].item())
        if exact:
            # the case is as it was meant (no rounding can move it)
            assert margin >= MARGIN, (
                j,
                margin,
            )
            assert counts["kernel"] == counts["rule"] == counts["sort"], (j, counts)
            assert got[j, 0].item() == want, (j, got[j, 0].item(), want)
        else:  # flat rows: the kept set is the rule's at a top_p within TOLERANCE
            most, fewest = (
                kept_count(row, reference_threshold(row, k, p + s * TOLERANCE)[0]) for s in (1, -1)
            )
            assert fewest <= counts["kernel"] <= most, (j, fewest, counts, most)
            # as meant: the crossing lies among many tokens of similar mass
            assert counts["kernel"] > vocab // 10
    # on CUDA apply_top_k_top_p takes the kernel's threshold; elsewhere the sort's
    applied = apply_top_k_top_p(logits.to(device), top_k, top_p).cpu()
    threshold = got if device == "cuda" else by_sort
    assert torch.equal(applied, logits.masked_fill(logits < threshold, float("-inf")))


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_refuses_logits_it_cannot_read(device):
    from spmoe.engine.sampling.top_k_top_p_triton import top_k_top_p_threshold

    k, p = torch.zeros(2, dtype=torch.int64, device=device), torch.ones(2, device=device)
    with pytest.raises(ValueError, match="float32 logits"):
        top_k_top_p_threshold(torch.zeros(2, 8, dtype=torch.float16, device=device), k, p)
    with pytest.raises(ValueError, match="need 2 values each"):
        top_k_top_p_threshold(torch.zeros(2, 8, device=device), k[:1], p)
