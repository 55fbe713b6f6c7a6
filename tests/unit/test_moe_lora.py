"""LoRA on a mixture-of-experts model (the built-in `tiny-moe`, a Qwen3-MoE with 4 experts, 2 per token): the
trainer adapts attention, each layer's fused experts and the router, and its logits equal a float64-free reference
that adds every expert's delta by hand (PEFT's layout: A is [experts x r, in] with each expert's rows together, B is
[out, r x experts] with the expert index fastest; gate_up at rank 2r); one step trains the experts; the memory plan
counts the model's parameters exactly."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers import make_cfg
from trainer.backends.tiny_model import MOE_SHAPE, ensure_tiny_model
from trainer.orchestration.model_shape import ModelShape, load_model_config

IDS = torch.tensor([[1, 5, 6, 7, 8, 100, 200, 300, 400, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
EXPERTS = MOE_SHAPE["num_experts"]


def moe_backend(tmp_path: Any) -> Any:
    from trainer.backends.local import LocalBackend

    return LocalBackend(make_cfg(tmp_path, model__path="tiny-moe", lora__target_modules="all-linear"))


def expert_delta(module: Any) -> torch.Tensor:
    """Each expert's delta weight [experts, out, in] from a PEFT ParamWrapper's A and B, by hand."""
    a, b, scale = module.lora_A["default"].weight, module.lora_B["default"].weight, module.scaling["default"]
    rank = a.shape[0] // EXPERTS
    a_e = a.reshape(EXPERTS, rank, a.shape[1])
    b_e = b.reshape(b.shape[0], rank, EXPERTS)
    return torch.stack([scale * b_e[:, :, e] @ a_e[e] for e in range(EXPERTS)])


def merged_by_hand(peft_model: Any) -> Any:
    """The base model with every LoRA delta added to its weights: attention, experts, router."""
    from transformers import AutoModelForCausalLM

    modules = dict(peft_model.named_modules())
    reference = AutoModelForCausalLM.from_pretrained(
        str(ensure_tiny_model(moe=True)), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for name, mod in modules.items():
            if not hasattr(mod, "lora_A") or "default" not in mod.lora_A:
                continue
            owner = name.removeprefix("base_model.model.")
            if owner.endswith("mlp.experts.base_layer") or owner.endswith("mlp.experts"):
                experts = reference.get_submodule(owner.removesuffix(".base_layer"))
                target = experts.gate_up_proj if mod.parameter_name == "gate_up_proj" else experts.down_proj
                target.data.add_(expert_delta(mod))
                continue
            scale = mod.scaling["default"]
            reference.get_submodule(owner).weight.data.add_(
                scale * mod.lora_B["default"].weight @ mod.lora_A["default"].weight
            )
    return reference


def test_expert_lora_logits_equal_the_per_expert_deltas_added_by_hand(tmp_path):
    backend = moe_backend(tmp_path)
    model = backend.model
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("mlp.experts.base_layer.lora_A" in n for n in trained)  # gate_up
    assert any("mlp.experts.lora_B" in n for n in trained)  # down
    assert any("mlp.gate.lora_A" in n for n in trained)  # the router
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.eval()
    with torch.no_grad():
        got = model(IDS).logits
        base = model.get_base_model()
        with model.disable_adapter():
            plain = base(IDS).logits
        expected = merged_by_hand(model)(IDS).logits
    assert (got - expected).abs().max().item() < 1e-5
    assert (got - plain).abs().max().item() > 1e-2, "the adapter changed nothing: the test proves nothing"


def test_one_step_trains_the_experts(tmp_path):
    from trainer.training.backend import AdamParams
    from trainer.training.batch import TrainingExample

    backend = moe_backend(tmp_path)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    ids = IDS[0].tolist()
    examples = [
        TrainingExample(ids, ids, [1.0] * len(ids), [-1.0] * len(ids), [0.5 - k] * len(ids)) for k in (0, 1)
    ]
    adam = AdamParams(
        learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0
    )
    backend.train_step(examples, backend.cfg.loss.params(), "sum", adam)
    moved = {
        n for n, p in backend.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])
    }
    assert any("mlp.experts.base_layer" in n for n in moved) and any("mlp.experts.lora" in n for n in moved)


def test_the_plan_counts_the_tiny_moe_exactly():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model(moe=True)))
    config = load_model_config("tiny-moe")
    assert config is not None
    shape = ModelShape.from_config(config)
    assert shape.experts is not None and shape.experts.count == EXPERTS
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters())
