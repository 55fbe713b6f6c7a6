"""trainer.training.losses against float64 references written here (per token; per sequence for gspo; soft-target
cross-entropy through the lm_head logprobs), plus invariances and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.training.logprobs import compute_token_logprobs
from trainer.training.loss_params import LossParams
from trainer.training.losses import (
    LossInputs,
    compute_loss,
    compute_reduction_weights,
    finalize_metrics,
    soft_cross_entropy,
)

PER_TOKEN_LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "grpo"]
ALL_LOSSES = [*PER_TOKEN_LOSSES, "gspo"]
REDUCTIONS = ["sum", "token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


def tis_shift(lp: float, lq: float, p: LossParams) -> float:
    """Truncated IS divides the ratio by a stop-gradient constant: max(1, r / cap)."""
    return 0.0 if p.tis_cap is None else max(0.0, lp - lq - math.log(p.tis_cap))


def reference_token_loss(name, lp, lq, adv, w, p: LossParams, shift: float | None = None) -> float:
    """One token's loss, straight from Tinker's documented formulas (python floats, float64)."""
    low, high = p.clip_bounds()
    r = math.exp(lp - lq - (tis_shift(lp, lq, p) if shift is None else shift))
    if name == "cross_entropy":
        return -lp * w
    if name == "importance_sampling":
        return -r * adv * w
    if name in ("ppo", "grpo"):
        return -min(r * adv, min(max(r, low), high) * adv) * w
    if name == "cispo":
        return -min(max(r, low), high) * lp * adv * w
    if name == "dro":
        return -(lp * adv - 0.5 * p.beta * (lp - lq) ** 2) * w
    raise AssertionError(name)


def reference_loss(name, lp_BT, lq_BT, adv_BT, mask_BT, p, reduction, keep_BT=None) -> float:
    """The summed, reduced loss; with `keep_BT` only the kept tokens count, each scaled as in the unmasked batch."""
    B, T = lp_BT.shape
    n_tokens = float(mask_BT.sum())
    total = 0.0
    for b in range(B):
        seq_tokens = float(mask_BT[b].sum())
        for t in range(T):
            if mask_BT[b, t] == 0 or (keep_BT is not None and not keep_BT[b, t]):
                continue
            tok = reference_token_loss(
                name, float(lp_BT[b, t]), float(lq_BT[b, t]), float(adv_BT[b, t]), float(mask_BT[b, t]), p
            )
            scale = {
                "sum": 1.0,
                "token_mean": 1.0 / n_tokens,
                "seq_mean_token_sum": 1.0 / B,
                "seq_mean_token_mean": 1.0 / (seq_tokens * B),
            }[reduction]
            total += tok * scale
    return total


def reference_grad(name, lp_BT, lq_BT, adv_BT, mask_BT, p, reduction) -> torch.Tensor:
    """d loss / d trainer_logprob by central finite differences on the float64 reference (stop-grads honoured
    analytically: cispo's clipped ratio is a constant, so its derivative is clip(r) * adv)."""
    grad = torch.zeros_like(lp_BT, dtype=torch.float64)
    eps = 1e-6
    B = lp_BT.shape[0]
    n_tokens = float(mask_BT.sum())
    low, high = p.clip_bounds()
    for b in range(B):
        seq_tokens = float(mask_BT[b].sum())
        for t in range(lp_BT.shape[1]):
            if mask_BT[b, t] == 0:
                continue
            scale = {
                "sum": 1.0,
                "token_mean": 1.0 / n_tokens,
                "seq_mean_token_sum": 1.0 / B,
                "seq_mean_token_mean": 1.0 / (seq_tokens * B),
            }[reduction]
            lp, lq, a, w = (float(x[b, t]) for x in (lp_BT, lq_BT, adv_BT, mask_BT))
            if name == "cispo":
                r = min(math.exp(lp - lq), p.tis_cap or math.inf)
                g = -min(max(r, low), high) * a * w
            else:
                c = tis_shift(lp, lq, p)  # held fixed: it is a stop-gradient constant
                g = (
                    reference_token_loss(name, lp + eps, lq, a, w, p, c)
                    - reference_token_loss(name, lp - eps, lq, a, w, p, c)
                ) / (2 * eps)
            grad[b, t] = g * scale
    return grad


def make_inputs(seed: int = 0, B: int = 3, T: int = 7, spread: float = 0.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lq = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 0.1
    lp = lq + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = torch.minimum(lp, torch.full_like(lp, -1e-3))
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    return lp.to(dtype), lq.to(dtype), adv.to(dtype), mask.to(dtype)


def run_loss(lp, lq, adv, mask, p, reduction="sum", B_total=None, tokens_total=None, seq_mask=None):
    lp = lp.clone().requires_grad_(True)
    weights = compute_reduction_weights(
        mask,
        reduction,
        float(mask.sum()) if tokens_total is None else tokens_total,
        lp.shape[0] if B_total is None else B_total,
    )
    loss, metrics = compute_loss(LossInputs(lp, lq, adv, mask, weights, seq_mask), p)
    loss.backward()
    return loss, lp.grad, metrics


@pytest.mark.parametrize("name", PER_TOKEN_LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_value_and_grad_match_float64_reference(name, reduction):
    lp, lq, adv, mask = make_inputs(seed=hash((name, reduction)) % 1000, spread=0.4)
    p = LossParams(name=name)
    loss, grad, _ = run_loss(lp, lq, adv, mask, p, reduction)
    ref = reference_loss(name, lp.double(), lq.double(), adv.double(), mask.double(), p, reduction)
    ref_grad = reference_grad(name, lp.double(), lq.double(), adv.double(), mask.double(), p, reduction)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6), (
        f"{name}/{reduction}: {loss.item()} vs {ref}"
    )
    diff = (grad.double() - ref_grad).abs().max().item()
    assert diff < 1e-4, f"{name}/{reduction}: max grad diff {diff}"


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "grpo"])
def test_truncated_importance_sampling_caps_value_and_gradient(name):
    lp, lq, adv, mask = make_inputs(seed=3, spread=1.5)  # wide spread: many ratios above the cap
    p = LossParams(name=name, tis_cap=1.5)
    loss, grad, metrics = run_loss(lp, lq, adv, mask, p)
    ref = reference_loss(name, lp.double(), lq.double(), adv.double(), mask.double(), p, "sum")
    ref_grad = reference_grad(name, lp.double(), lq.double(), adv.double(), mask.double(), p, "sum")
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert (grad.double() - ref_grad).abs().max().item() < 1e-4
    ratio = torch.exp(lp - lq)[mask != 0]
    assert metrics["importance/clipped_tokens"] >= int((ratio > 1.5).sum())


def test_importance_sampling_gradient_is_ratio_times_advantage():
    lp, lq, adv, mask = make_inputs(seed=5)
    _, grad, _ = run_loss(lp, lq, adv, mask, LossParams("importance_sampling"))
    expected = torch.where(mask != 0, -torch.exp(lp - lq) * adv, torch.zeros_like(lp))
    assert torch.allclose(grad, expected, atol=1e-6)


def test_custom_clip_thresholds_are_used():
    lp, lq, adv, mask = make_inputs(seed=7, spread=0.6)
    default, _, m_default = run_loss(lp, lq, adv, mask, LossParams("ppo"))
    tight, _, m_tight = run_loss(
        lp, lq, adv, mask, LossParams("ppo", clip_low_threshold=0.95, clip_high_threshold=1.05)
    )
    assert m_tight["importance/clipped_tokens"] > m_default["importance/clipped_tokens"]
    assert tight.item() != pytest.approx(default.item())


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_padding_with_mask_zero_changes_nothing(name):
    lp, lq, adv, mask = make_inputs(seed=11)
    p = LossParams(name=name)
    loss, grad, metrics = run_loss(lp, lq, adv, mask, p, "seq_mean_token_mean")
    pad = 5
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -3.0])[None].expand(
        lp.shape[0], pad
    )
    padded = [torch.cat([x, junk], dim=1) for x in (lp, lq, adv)]
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], pad)], dim=1)
    loss_p, grad_p, metrics_p = run_loss(*padded, padded_mask, p, "seq_mean_token_mean")
    assert loss_p.item() == pytest.approx(loss.item(), rel=1e-6, abs=1e-7)
    assert torch.equal(grad_p[:, : lp.shape[1]], grad)
    assert torch.all(grad_p[:, lp.shape[1] :] == 0)
    assert metrics_p == metrics


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cross_entropy", "gspo"])
def test_grad_accumulation_equals_one_big_batch(name, reduction):
    lp, lq, adv, mask = make_inputs(seed=13, B=4, T=9)
    p = LossParams(name=name)
    full_loss, full_grad, full_metrics = run_loss(lp, lq, adv, mask, p, reduction)
    total_tokens = float(mask.sum())
    parts, grads, loss_sum = [], [], 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        loss, grad, metrics = run_loss(
            lp[rows], lq[rows], adv[rows], mask[rows], p, reduction, B_total=4, tokens_total=total_tokens
        )
        loss_sum += loss.item()
        grads.append(grad)
        parts.append(metrics)
    assert loss_sum == pytest.approx(full_loss.item(), rel=1e-5)
    assert torch.allclose(torch.cat(grads), full_grad, atol=1e-7)
    assert finalize_metrics(parts) == pytest.approx(finalize_metrics([full_metrics]))


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "grpo"])
def test_ratio_is_one_when_logprobs_match(name):
    lp, _, adv, mask = make_inputs(seed=17)
    _, _, metrics = run_loss(lp, lp.clone(), adv, mask, LossParams(name))
    m = finalize_metrics([metrics])
    assert m["importance/ratio_mean"] == 1.0
    assert m["importance/ratio_min"] == 1.0 and m["importance/ratio_max"] == 1.0
    assert m["importance/mismatch_kl"] == 0.0
    assert m["importance/clip_fraction"] == 0.0
    assert m["importance/logprob_diff_mean"] == 0.0


def test_mismatch_kl_is_k3_estimate():
    lp, lq, adv, mask = make_inputs(seed=19, spread=0.3)
    _, _, metrics = run_loss(lp, lq, adv, mask, LossParams("importance_sampling"))
    sel = mask != 0
    log_r = (lp - lq).double()[sel]
    expected = (torch.exp(log_r) - 1 - log_r).mean().item()
    assert finalize_metrics([metrics])["importance/mismatch_kl"] == pytest.approx(expected, rel=1e-6)
    assert finalize_metrics([metrics])["importance/logprob_diff_mean"] == pytest.approx(
        log_r.abs().mean().item()
    )


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_all_masked_gives_zero_loss_and_grads(name):
    lp, lq, adv, _ = make_inputs(seed=23)
    mask = torch.zeros_like(lp)
    for reduction in REDUCTIONS:
        loss, grad, metrics = run_loss(lp, lq, adv, mask, LossParams(name), reduction)
        assert loss.item() == 0.0 and torch.all(grad == 0)
        m = finalize_metrics([metrics])
        assert m["tokens/trained"] == 0 and math.isnan(m["importance/ratio_mean"])


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_nan_and_inf_at_masked_positions_stay_out(name):
    lp, lq, adv, mask = make_inputs(seed=29)
    clean_loss, clean_grad, _ = run_loss(lp, lq, adv, mask, LossParams(name))
    hole = mask == 0
    assert hole.any()
    lp2, lq2, adv2 = lp.clone(), lq.clone(), adv.clone()
    lp2[hole], lq2[hole], adv2[hole] = float("nan"), float("inf"), float("-inf")
    loss, grad, _ = run_loss(lp2, lq2, adv2, mask, LossParams(name))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.item() == pytest.approx(clean_loss.item(), rel=1e-6)
    assert torch.equal(grad, clean_grad)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_bf16_inputs_stay_finite_and_close(name):
    lp, lq, adv, mask = make_inputs(seed=31, spread=2.0)
    p = LossParams(name=name, tis_cap=None if name in ("cross_entropy", "dro", "gspo") else 4.0)
    ref_loss, _, _ = run_loss(lp, lq, adv, mask, p)
    bf = [x.to(torch.bfloat16) for x in (lp, lq, adv, mask)]
    loss, grad, _ = run_loss(*bf, p)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.float().item() == pytest.approx(ref_loss.item(), rel=0.1, abs=0.5)


def test_tis_cap_survives_extreme_log_ratio():
    lp = torch.tensor([[-0.01, -0.01]])
    lq = torch.tensor([[-200.0, -0.5]])  # exp(199.99) overflows fp32 without the cap
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones_like(lp)
    loss, grad, _ = run_loss(lp, lq, adv, mask, LossParams("importance_sampling", tis_cap=2.0))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.item() == pytest.approx(-2.0 + math.exp(0.49), rel=1e-5)


def test_tis_cap_rejected_for_non_ratio_losses():
    lp, lq, adv, mask = make_inputs()
    with pytest.raises(ValueError, match="tis_cap"):
        run_loss(lp, lq, adv, mask, LossParams("dro", tis_cap=2.0))


# --- gspo ---------------------------------------------------------------------------------------------------------


def reference_gspo(lp_BT, lq_BT, adv_BT, mask_BT, seq_mask_BT, p: LossParams, reduction: str):
    """Loss and d loss / d trainer_logprob from Tinker's GSPO-token page, in python floats: per sequence
    s = exp(mean of lp - lq over the sequence mask) (1 when it marks nothing); every token's ratio has the value s
    and d ratio_t / d lp_t = s; loss_t = -min(ratio_t * A_t, clip(ratio_t, low, high) * A_t) * w_t. The gradient
    is a central difference of that token loss with s held fixed (it is a stop-gradient value)."""
    low, high = p.clip_bounds()
    B, T = lp_BT.shape
    n_tokens = float(mask_BT.sum())
    grad = torch.zeros(B, T, dtype=torch.float64)
    total = 0.0
    for b in range(B):
        marked = [t for t in range(T) if seq_mask_BT[b, t] != 0]
        s = math.exp(sum(float(lp_BT[b, t] - lq_BT[b, t]) for t in marked) / len(marked)) if marked else 1.0
        seq_tokens = float(mask_BT[b].sum())
        for t in range(T):
            w = float(mask_BT[b, t])
            if w == 0:
                continue
            a, lp0 = float(adv_BT[b, t]), float(lp_BT[b, t])

            def token(lp, a=a, lp0=lp0, w=w, s=s):
                r = s * math.exp(lp - lp0)
                return -min(r * a, min(max(r, low), high) * a) * w

            scale = {
                "sum": 1.0,
                "token_mean": 1.0 / n_tokens,
                "seq_mean_token_sum": 1.0 / B,
                "seq_mean_token_mean": 1.0 / (seq_tokens * B),
            }[reduction]
            total += token(lp0) * scale
            grad[b, t] = (token(lp0 + 1e-6) - token(lp0 - 1e-6)) / 2e-6 * scale
    return total, grad


def gspo_inputs(seed: int, spread: float):
    lp, lq, adv, mask = make_inputs(seed=seed, B=4, T=9, spread=spread)
    g = torch.Generator().manual_seed(seed + 1)
    # The sequence mask differs from the weights on purpose: it may mark untrained tokens and skip trained ones.
    seq_mask = (torch.rand(lp.shape, generator=g) > 0.4).float()
    seq_mask[:, 1] = 1.0
    return lp, lq, adv, mask, seq_mask


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("spread", [0.05, 0.6])  # all sequences inside the clip range, then several outside
def test_gspo_value_and_grad_match_float64_reference(reduction, spread):
    lp, lq, adv, mask, seq_mask = gspo_inputs(seed=37, spread=spread)
    p = LossParams("gspo")
    loss, grad, metrics = run_loss(lp, lq, adv, mask, p, reduction, seq_mask=seq_mask)
    ref, ref_grad = reference_gspo(*(x.double() for x in (lp, lq, adv, mask, seq_mask)), p, reduction)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert (grad.double() - ref_grad).abs().max().item() < 1e-4
    low, high = p.clip_bounds()
    log_s = torch.stack([(lp - lq).double()[b][seq_mask[b] != 0].mean() for b in range(lp.shape[0])])
    outside = (log_s.exp() < low) | (log_s.exp() > high)
    assert bool(outside.any()) == (spread > 0.5), "the inputs do not exercise what the case is for"
    assert metrics["importance/clipped_tokens"] == float((mask != 0)[outside].sum())


def test_gspo_sequence_mask_defaults_to_the_trained_tokens():
    lp, lq, adv, mask, _ = gspo_inputs(seed=41, spread=0.4)
    loss, grad, _ = run_loss(lp, lq, adv, mask, LossParams("gspo"))
    ref, ref_grad = reference_gspo(
        *(x.double() for x in (lp, lq, adv, mask, mask)), LossParams("gspo"), "sum"
    )
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert (grad.double() - ref_grad).abs().max().item() < 1e-4


def test_gspo_equals_ppo_when_every_token_has_the_sequence_ratio():
    """A constant log-ratio per sequence makes the geometric mean equal to each token's ratio."""
    lp, _, adv, mask = make_inputs(seed=43, B=3, T=6)
    shift = torch.tensor([[0.05], [-0.5], [0.4]])  # inside, below and above PPO's clip range
    lq = lp - shift
    gspo_loss, gspo_grad, _ = run_loss(lp, lq, adv, mask, LossParams("gspo"))
    ppo_loss, ppo_grad, _ = run_loss(lp, lq, adv, mask, LossParams("ppo"))
    assert gspo_loss.item() == pytest.approx(ppo_loss.item(), rel=1e-6)
    assert torch.allclose(gspo_grad, ppo_grad, atol=1e-6)


def test_gspo_sequence_that_marks_no_token_has_ratio_one():
    lp, lq, adv, mask, seq_mask = gspo_inputs(seed=47, spread=0.6)
    seq_mask[1] = 0.0
    loss, grad, _ = run_loss(lp, lq, adv, mask, LossParams("gspo"), seq_mask=seq_mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # s = 1 sits inside the clip range: the row's gradient is -A * w, as on-policy PPO's.
    assert torch.allclose(grad[1], -(adv[1] * mask[1]), atol=1e-6)
    ref, _ = reference_gspo(*(x.double() for x in (lp, lq, adv, mask, seq_mask)), LossParams("gspo"), "sum")
    assert loss.item() == pytest.approx(ref, rel=1e-5)


def test_gspo_custom_clip_thresholds_are_used():
    lp, lq, adv, mask, seq_mask = gspo_inputs(seed=53, spread=0.3)
    wide = LossParams("gspo", clip_low_threshold=0.0, clip_high_threshold=100.0)
    tight = LossParams("gspo", clip_low_threshold=0.999, clip_high_threshold=1.001)
    _, _, m_wide = run_loss(lp, lq, adv, mask, wide, seq_mask=seq_mask)
    loss, grad, m_tight = run_loss(lp, lq, adv, mask, tight, seq_mask=seq_mask)
    assert m_wide["importance/clipped_tokens"] == 0 < m_tight["importance/clipped_tokens"]
    ref, ref_grad = reference_gspo(*(x.double() for x in (lp, lq, adv, mask, seq_mask)), tight, "sum")
    assert loss.item() == pytest.approx(ref, rel=1e-5) and (grad.double() - ref_grad).abs().max() < 1e-4


def test_gspo_nan_outside_both_masks_stays_out():
    lp, lq, adv, mask, seq_mask = gspo_inputs(seed=59, spread=0.3)
    clean_loss, clean_grad, _ = run_loss(lp, lq, adv, mask, LossParams("gspo"), seq_mask=seq_mask)
    hole = (mask == 0) & (seq_mask == 0)
    assert hole.any()
    lp2, lq2 = lp.clone(), lq.clone()
    lp2[hole], lq2[hole] = float("nan"), float("inf")
    loss, grad, _ = run_loss(lp2, lq2, adv, mask, LossParams("gspo"), seq_mask=seq_mask)
    assert loss.item() == pytest.approx(clean_loss.item(), rel=1e-6)
    assert torch.equal(grad, clean_grad)


def test_gspo_refuses_tis_cap():
    lp, lq, adv, mask = make_inputs()
    with pytest.raises(ValueError, match="tis_cap"):
        run_loss(lp, lq, adv, mask, LossParams("gspo", tis_cap=2.0))


# --- soft-target cross-entropy ((N, K) targets) -------------------------------------------------------------------


def test_soft_cross_entropy_through_logprobs_matches_float64_reference():
    """-sum_t sum_k w[t, k] * log p(x[t, k]) from the chunked lm_head path, against float64 log_softmax, value and
    gradients (hidden states and head weight)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets = torch.randint(0, 50, (2, 5, 4))
    weights = torch.rand(2, 5, 4)
    weights[0, 3] = 0.0  # a position with no weight at all
    weights[1, :, 2] = 0.0  # a column left empty
    select = torch.ones(2, 5, dtype=torch.bool)
    lp = compute_token_logprobs(head, hidden, targets, select, chunk_tokens=3)
    assert lp.shape == (2, 5, 4)
    loss = soft_cross_entropy(lp, weights)
    full = torch.log_softmax(head(hidden).double(), -1)
    ref_lp = torch.stack([full.gather(2, targets[..., k : k + 1])[..., 0] for k in range(4)], -1)
    ref = -(weights.double() * ref_lp).sum()
    assert (lp.double() - ref_lp).abs().max() < 1e-5
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    got = torch.autograd.grad(loss, [hidden, head.weight])
    want = torch.autograd.grad(ref, [hidden, head.weight])
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b).abs().max() < 1e-5


def test_soft_cross_entropy_with_k_1_is_cross_entropy():
    lp, lq, adv, mask = make_inputs(seed=61)
    weights = mask * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    hard_loss, hard_grad, _ = run_loss(lp, lq, adv, weights, LossParams("cross_entropy"))
    soft_lp = lp.clone().requires_grad_(True)
    soft_loss = soft_cross_entropy(soft_lp[..., None], weights[..., None])
    soft_loss.backward()
    assert soft_loss.item() == pytest.approx(hard_loss.item(), rel=1e-6)
    assert torch.allclose(soft_lp.grad, hard_grad, atol=1e-7)
    torch.manual_seed(2)
    head, hidden = torch.nn.Linear(8, 30, bias=False), torch.randn(2, 4, 8)
    ids = torch.randint(0, 30, (2, 4))
    select = torch.rand(2, 4) > 0.3
    plain = compute_token_logprobs(head, hidden, ids, select)
    assert torch.equal(compute_token_logprobs(head, hidden, ids[..., None], select)[..., 0], plain)


def test_soft_cross_entropy_zero_weight_cells_stay_out():
    lp = torch.tensor([[[-1.0, float("nan")], [-0.5, -2.0]]], requires_grad=True)
    weights = torch.tensor([[[0.7, 0.0], [0.2, 0.1]]])
    loss = soft_cross_entropy(lp, weights)
    loss.backward()
    assert loss.item() == pytest.approx(0.7 + 0.1 + 0.2)
    assert torch.equal(lp.grad, -weights)
    with pytest.raises(ValueError, match=r"logprobs \[1, 2, 2\] and weights \[1, 2\]"):
        soft_cross_entropy(lp, weights[..., 0])
