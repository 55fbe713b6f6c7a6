"""trainer.training.losses against a float64 per-token reference written here, plus invariances and edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.training.losses import (
    LossInputs,
    LossParams,
    compute_loss,
    compute_reduction_weights,
    finalize_metrics,
)

ALL_LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "grpo"]
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


def reference_loss(name, lp_BT, lq_BT, adv_BT, mask_BT, p, reduction) -> float:
    B, T = lp_BT.shape
    n_tokens = float(mask_BT.sum())
    total = 0.0
    for b in range(B):
        seq_tokens = float(mask_BT[b].sum())
        for t in range(T):
            if mask_BT[b, t] == 0:
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


def run_loss(lp, lq, adv, mask, p, reduction="sum", B_total=None, tokens_total=None):
    lp = lp.clone().requires_grad_(True)
    weights = compute_reduction_weights(
        mask,
        reduction,
        float(mask.sum()) if tokens_total is None else tokens_total,
        lp.shape[0] if B_total is None else B_total,
    )
    loss, metrics = compute_loss(LossInputs(lp, lq, adv, mask, weights), p)
    loss.backward()
    return loss, lp.grad, metrics


@pytest.mark.parametrize("name", ALL_LOSSES)
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
@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cross_entropy"])
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
    p = LossParams(name=name, tis_cap=None if name in ("cross_entropy", "dro") else 4.0)
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
