"""`python -m trainer export` on a run folder the local backend wrote (the tiny model): the adapter folder loads with
PEFT alone and names its base; the merged folder loads with transformers alone, its tokenizer and chat template
work, and its logits are base + adapter's (PEFT, float32) to 1e-4, for an adapter that trains lm_head and one that
does not; the model card names the base, the step and the eval figures; every refusal says what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.helpers import ALL_TARGETS, make_cfg
from trainer.backends.tiny_model import ensure_tiny_model
from trainer.export import cli
from trainer.export.card import base_licence
from trainer.export.origin import ExportError, hub_origin
from trainer.export.source import find_source

IDS = torch.tensor([[1, 5, 6, 7, 8, 100, 200, 300, 400, 9]])


def write_run(
    run_dir: Path, targets: list[str], versions: int = 2, backend: str = "local", model: Path | None = None
) -> Path:
    """A run folder as a launch leaves it: config.yaml naming the model folder, adapters/vN, metrics and evals."""
    from trainer.backends.local import LocalBackend

    model = model or ensure_tiny_model()
    cfg = make_cfg(run_dir, lora__target_modules=targets, model__path=str(model))
    trainer = LocalBackend(cfg)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for v in range(1, versions + 1):
        with torch.no_grad():
            for p in trainer.params:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        trainer.save_for_sampler(v)
        rows.append({"step": v, "policy_version": v, "loss": 0.1})
    data = cfg.model_dump(mode="json")
    data["launch"]["backend"] = backend
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [
        {"step": None, "policy_version": 0, "target": "base", "env": "toy", "status": "ok", "eval/pass@1": 0.125},
        {"step": versions, "policy_version": versions, "target": f"v{versions}", "env": "toy", "status": "ok",
         "eval/pass@1": 0.5},
    ]  # fmt: skip
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("run"), ALL_TARGETS)


def peft_logits(adapter: Path, model: Path | None = None) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model or ensure_tiny_model()), dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, str(adapter)).eval()(IDS).logits


def model_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(IDS).logits


@pytest.mark.parametrize(
    "targets", [ALL_TARGETS, ["q_proj", "v_proj"]], ids=["with-lm-head", "attention-only"]
)
def test_the_merged_model_is_base_plus_adapter(tmp_path, targets):
    from transformers import AutoTokenizer

    src = write_run(tmp_path / "run", targets, versions=1)
    out = tmp_path / "merged"
    assert cli.main([str(src), "--out", str(out), "--merge"]) == 0
    expected = peft_logits(src / "adapters" / "v000001")
    base = model_logits(ensure_tiny_model())
    got = model_logits(out)
    assert (got - expected).abs().max().item() < 1e-4
    assert (base - expected).abs().max().item() > 1e-2, "the adapter changed nothing: the test proves nothing"
    files = (
        "README.md chat_template.jinja config.json generation_config.json model.safetensors tokenizer.json"
    )
    assert sorted(p.name for p in out.iterdir()) == sorted([*files.split(), "tokenizer_config.json"])
    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "Hi" in text


def test_a_tied_lm_head_gets_its_own_weight_and_the_embeddings_stay_the_bases(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tied = tmp_path / "tied"
    shutil.copytree(ensure_tiny_model(), tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(str(tied / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(tied / "model.safetensors"))
    src = write_run(tmp_path / "run", ALL_TARGETS, versions=1, model=tied)
    out = tmp_path / "merged"
    assert cli.main([str(src), "--out", str(out), "--merge"]) == 0
    assert (model_logits(out) - peft_logits(src / "adapters" / "v000001", tied)).abs().max().item() < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.float32)
    assert not merged.config.tie_word_embeddings
    assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)


def test_the_adapter_folder_loads_with_peft_and_names_its_base(run, tmp_path):
    out = tmp_path / "adapter"
    assert cli.main([str(run), "--out", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ensure_tiny_model())
    assert torch.equal(peft_logits(out), peft_logits(run / "adapters" / "v000002"))
    assert not list(tmp_path.glob(".adapter.partial-*"))


def test_the_card_names_the_base_the_step_and_the_eval_figures(run, tmp_path):
    out = tmp_path / "v1"
    assert cli.main([str(run), "--out", str(out), "--step", "1"]) == 0
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert "base_model" not in front and front["library_name"] == "peft"  # a local folder is no hub id
    assert f"on `{ensure_tiny_model()}`" in card
    assert "version 1 (step 1)" in card and "steps: 1 of" in card
    assert (
        "0.125" in card and "0.5" not in card
    )  # the base's figure; version 2's evaluation is not version 1's
    card2 = (cli.export(find_source(run), tmp_path / "v2", False, "auto") / "README.md").read_text()
    assert "| toy | pass@1 | 0.125 | 0.5 |" in card2


def test_a_snapshot_folder_is_named_by_its_hub_id_and_revision(tmp_path):
    folder = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / ("ab" * 20)
    assert hub_origin(folder).name == "meta-llama/Llama-3.1-8B" and hub_origin(folder).revision == "ab" * 20
    assert hub_origin(tmp_path).hub_id is None
    assert base_licence("---\nlicense: llama3.1\ntags: [x]\n---\n# card") == "llama3.1"
    assert base_licence("# no front matter\nlicense: mit") is None


def refusal(args: list[str], capsys: Any) -> str:
    assert cli.main(args) == 2
    return capsys.readouterr().err


def test_refusals_say_what_was_found_and_what_to_do(run, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    assert "never published" in refusal([str(run), "--out", out, "--version", "7"], capsys)
    assert "published: 1, 2" in refusal([str(run), "--out", out, "--version", "7"], capsys)
    assert "step 9 published no version" in refusal([str(run), "--out", out, "--step", "9"], capsys)
    assert "not a run folder" in refusal([str(tmp_path), "--out", out], capsys)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copyfile(run / "config.yaml", fresh / "config.yaml")
    assert "no adapter yet" in refusal([str(fresh), "--out", out], capsys)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert "not empty" in refusal([str(run), "--out", str(busy)], capsys)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))  # type: ignore[attr-defined]
    msg = refusal([str(run), "--out", out, "--merge"], capsys)
    assert "GB is free there" in msg and "--out on a larger disk" in msg
    assert not (tmp_path / "out").exists()


def test_a_base_model_not_here_or_a_tinker_run_is_refused_with_what_to_do(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", ["q_proj"], versions=1)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"]["path"] = "someorg/not-downloaded-model"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = refusal([str(run), "--out", str(tmp_path / "o")], capsys)
    assert "not available offline" in msg and "hf download someorg/not-downloaded-model" in msg
    config["model"]["path"] = str(tmp_path / "moved-away")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert "is gone" in refusal([str(run), "--out", str(tmp_path / "o")], capsys)
    config["launch"]["backend"] = "tinker"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert "trained on Tinker" in refusal([str(run), "--out", str(tmp_path / "o")], capsys)


def test_a_checkpoint_and_an_adapter_folder_export_too(tmp_path):
    from trainer.backends.local import LocalBackend

    run = write_run(tmp_path / "run", ["q_proj"], versions=1)
    trainer = LocalBackend(make_cfg(run, lora__target_modules=["q_proj"]))
    ckpt = Path(trainer.save_state("step-000001"))
    src = find_source(ckpt)
    assert src.label == "checkpoint step-000001" and src.step == 1 and src.run_dir == run
    assert find_source(run / "adapters" / "v000001").version == 1
    with pytest.raises(ExportError, match="drop --version"):
        find_source(ckpt, version=1)
