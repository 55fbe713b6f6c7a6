"""loss.ratio_mask against float64 references written here: `token` leaves out each trained token whose
trainer/sampler ratio is outside [mask_low, mask_high], `sequence` every token of a sequence whose geometric-mean
ratio is; what is left trains exactly as the loss without a mask would (value and gradient), masked tokens keep
their place in the mean reductions' denominators, and the importance metrics still describe every trained token."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from tests.unit.test_losses import REDUCTIONS, make_inputs, reference_grad, reference_loss, run_loss
from trainer.training.config import ConfigError, RunConfig, load_config
from trainer.training.loss_params import LossParams
from trainer.training.losses import finalize_metrics

MASKED_PER_TOKEN = ["importance_sampling", "ppo", "cispo", "grpo"]


def reference_keep(lp_BT, lq_BT, mask_BT, p: LossParams) -> torch.Tensor:
    """Which trained tokens the mask keeps, by loops over python floats."""
    keep = torch.zeros_like(mask_BT, dtype=torch.bool)
    low, high = p.mask_low, p.mask_high
    for b in range(mask_BT.shape[0]):
        trained = [t for t in range(mask_BT.shape[1]) if mask_BT[b, t] != 0]
        if p.ratio_mask == "sequence":
            mean = sum(float(lp_BT[b, t]) - float(lq_BT[b, t]) for t in trained) / max(len(trained), 1)
            inside = low <= math.exp(mean) <= high
            for t in trained:
                keep[b, t] = inside
        else:
            for t in trained:
                keep[b, t] = low <= math.exp(float(lp_BT[b, t]) - float(lq_BT[b, t])) <= high
    return keep


@pytest.mark.parametrize("how", ["token", "sequence"])
@pytest.mark.parametrize("name", MASKED_PER_TOKEN)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_value_and_grad_match_the_float64_reference(how, name, reduction):
    lp, lq, adv, mask = make_inputs(
        seed=zlib.crc32(f"{how}{name}{reduction}".encode()) % 1000, B=8, spread=0.6
    )
    lq[0] -= 1.0  # the sampler found sequence 0 e times less likely: its mean ratio is out of bounds
    p = LossParams(name=name, ratio_mask=how, mask_low=0.7, mask_high=1.4)
    loss, grad, metrics = run_loss(lp, lq, adv, mask, p, reduction)
    d = [x.double() for x in (lp, lq, adv, mask)]
    keep = reference_keep(d[0], d[1], d[3], p)
    trained = mask != 0
    assert 0 < int(keep.sum()) < int(trained.sum()), "the bounds keep all or nothing: the test proves nothing"
    ref = reference_loss(name, *d, p, reduction, keep_BT=keep)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    # The keep decision is a stop-gradient: kept tokens get the loss's own gradient, masked ones none.
    ref_grad = torch.where(keep, reference_grad(name, *d, LossParams(name=name), reduction), 0.0)
    assert (grad.double() - ref_grad).abs().max().item() < 1e-4
    assert metrics["importance/masked_tokens"] == float((trained & ~keep).sum())


def test_the_metrics_describe_every_trained_token_and_add_the_masked_fraction():
    lp, lq, adv, mask = make_inputs(seed=11, B=5, spread=1.0)
    _, _, plain = run_loss(lp, lq, adv, mask, LossParams("ppo"))
    _, _, masked = run_loss(lp, lq, adv, mask, LossParams("ppo", ratio_mask="token"))
    for key in (
        "importance/ratio_sum",
        "importance/ratio_min",
        "importance/ratio_max",
        "importance/mismatch_kl_sum",
    ):
        assert masked[key] == plain[key], key
    final = finalize_metrics([masked, masked])
    assert final["importance/masked_fraction"] == pytest.approx(
        masked["importance/masked_tokens"] / float(mask.sum())
    )
    assert 0 < final["importance/masked_fraction"] < 1
    assert finalize_metrics([plain])["importance/masked_fraction"] == 0.0


def test_none_is_the_loss_as_it_was():
    lp, lq, adv, mask = make_inputs(seed=4, spread=1.0)
    a_loss, a_grad, _ = run_loss(lp, lq, adv, mask, LossParams("cispo"))
    b_loss, b_grad, _ = run_loss(lp, lq, adv, mask, LossParams("cispo", ratio_mask="none", mask_low=0.9))
    assert a_loss.item() == b_loss.item() and torch.equal(a_grad, b_grad)


@pytest.mark.parametrize("name", ["gspo", "stable_reinforce"])
def test_sequence_level_losses_leave_masked_sequences_out(name):
    lp, lq, adv, mask = make_inputs(seed=8, B=6, spread=0.8)
    p = LossParams(name, ratio_mask="sequence", mask_low=0.7, mask_high=1.4)
    loss, grad, _ = run_loss(lp, lq, adv, mask, p)
    keep = reference_keep(lp.double(), lq.double(), mask.double(), p)
    dropped = (mask != 0).any(1) & ~keep.any(1)
    assert dropped.any() and (~dropped).any(), (
        "no sequence or every sequence was masked: the test proves nothing"
    )
    assert torch.all(grad[dropped] == 0)
    # What is left is the loss of the kept sequences alone (gspo's ratio is per sequence: nothing else leaks in).
    kept_loss, kept_grad, _ = run_loss(
        lp[~dropped], lq[~dropped], adv[~dropped], mask[~dropped], LossParams(name)
    )
    assert loss.item() == pytest.approx(kept_loss.item(), rel=1e-6)
    assert torch.allclose(grad[~dropped], kept_grad, atol=1e-7)


def test_an_overflowing_ratio_is_masked_and_the_loss_stays_finite():
    lp, lq, adv, mask = make_inputs(seed=2)
    lp[0, 0] = lq[0, 0] + 300.0  # exp(300) overflows float32
    loss, grad, metrics = run_loss(lp, lq, adv, mask, LossParams("importance_sampling", ratio_mask="token"))
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all() and grad[0, 0] == 0
    assert metrics["importance/masked_tokens"] >= 1


def test_bad_settings_are_refused_with_the_reason():
    lp, lq, adv, mask = make_inputs(seed=1)
    with pytest.raises(ValueError, match="ratio_mask applies to"):
        run_loss(lp, lq, adv, mask, LossParams("dro", ratio_mask="token"))
    with pytest.raises(ValueError, match="0 < mask_low < 1 < mask_high"):
        run_loss(lp, lq, adv, mask, LossParams("ppo", ratio_mask="token", mask_low=1.2))
    with pytest.raises(ConfigError, match=r"loss\.ratio_mask applies to .* not loss\.name='cross_entropy'"):
        load_config(RunConfig, None, ["loss.name=cross_entropy", "loss.ratio_mask=sequence"])
    with pytest.raises(ConfigError, match="mask_high"):
        load_config(RunConfig, None, ["loss.ratio_mask=token", "loss.mask_high=0.9"])
    cfg = load_config(RunConfig, None, ["loss.ratio_mask=sequence", "loss.mask_low=0.8"])
    assert cfg.loss_params().ratio_mask == "sequence" and cfg.loss_params().mask_low == 0.8


def test_the_tinker_backend_refuses_a_ratio_mask():
    from trainer.backends.tinker import TinkerBackend

    with pytest.raises(ConfigError, match="not available with --backend tinker"):
        TinkerBackend._check_loss(None, LossParams("ppo", ratio_mask="token"), "sum")  # type: ignore[arg-type]
