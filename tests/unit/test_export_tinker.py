"""`python -m trainer export` of a `--backend tinker` run: the weights come off Tinker (here this project's
Tinker-protocol service in this process, through the unmodified SDK): the run's checkpoint's Tinker state, saved as
external weights and downloaded from signed URLs, is the adapter the trainer trained, and exports as a local run's
does (adapter folder, card)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import FIXTURE, make_cfg, training_service
from trainer.export import cli
from trainer.training.batch import IntakeOptions, convert_batch
from trainer.training.loss_params import LossParams
from trainer.training.schedule import adam_params

tinker = pytest.importorskip("tinker")


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[tuple[str, Any]]:
    with training_service(tmp_path_factory.mktemp("service")) as served:
        yield served


def tinker_run(run_dir: Path, url: str) -> Any:
    """A Tinker run's folder after two steps and a checkpoint, as the trainer leaves it (no weights in it); returns
    its backend (the training client on the service)."""
    from trainer.backends.tinker import TinkerBackend

    cfg = make_cfg(run_dir)
    backend = TinkerBackend(cfg, service=tinker.ServiceClient(base_url=url, api_key="tml-local-test"))
    examples = convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples[:4]
    for _ in range(2):
        backend.forward_backward(examples, LossParams("importance_sampling"), "token_mean")
        backend.optim_step(adam_params(1e-2))
    backend.save_state("step-000002")
    data = cfg.model_dump(mode="json")
    data["launch"]["backend"] = "tinker"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))
    rows = [{"step": s, "policy_version": s, "loss": 0.1} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return backend


def test_a_tinker_runs_checkpoint_is_downloaded_and_exported(tmp_path, service, monkeypatch, capsys):
    url, state = service
    run = tmp_path / "run"
    backend = tinker_run(run, url)
    name = state.models[backend.client.model_id]
    trained = {
        n.replace(f".{name}.", "."): p.detach().clone()
        for n, p in state.policies.peft.named_parameters()
        if f".{name}." in n
    }
    monkeypatch.setenv("TINKER_BASE_URL", url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-local-test")

    assert cli.main([str(run), "--out", str(tmp_path / "v"), "--version", "2"]) == 2
    assert "sampler weights, which Tinker does not hand out" in capsys.readouterr().err
    assert cli.main([str(run), "--out", str(tmp_path / "s"), "--step", "7"]) == 2
    assert "no Tinker checkpoint of step 7" in capsys.readouterr().err

    out = tmp_path / "export"
    assert cli.main([str(run), "--out", str(out)]) == 0
    exported = load_file(out / "adapter_model.safetensors")
    assert len(exported) == len(trained) > 0
    for key, tensor in exported.items():
        match = [t for n, t in trained.items() if n.endswith(key.removeprefix("base_model.model."))]
        assert len(match) == 1 and torch.equal(match[0], tensor), key
    assert (run / "tinker_exports" / "step-000002" / "adapter_config.json").is_file()
    card = (out / "README.md").read_text()
    assert "step-000002" in card

    # Offline afterwards: the downloaded folder is reused, Tinker is not asked again.
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")
    assert cli.main([str(run), "--out", str(tmp_path / "again")]) == 0
