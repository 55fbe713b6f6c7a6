"""The Tinker backend end to end in child processes: launch.sh's refusals without a key and its pre-flight,
the local path in an environment without tinker, a whole `launch.sh toy --backend tinker` run on the fake SDK
boundary (tests/fake_tinker.py), and a live smoke test when TINKER_API_KEY is set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker", reason="the tinker extra is not installed")

from tests.helpers import FIXTURE  # noqa: E402
from trainer.backends.tinker import TinkerBackend  # noqa: E402
from trainer.training.batch import IntakeOptions, convert_batch  # noqa: E402
from trainer.training.config import RunConfig, load_config  # noqa: E402
from trainer.training.loss_params import LossParams  # noqa: E402
from trainer.training.schedule import adam_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tinker.client_factory=tests.fake_tinker:make_service_client"


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TINKER_ROOT", str(tmp_path / "tinker"))
    return tmp_path


@pytest.fixture(scope="module")
def examples():
    return convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples


def test_launch_refuses_tinker_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TINKER_API_KEY"}
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "launch.sh"),
            "toy",
            "--backend",
            "tinker",
            "--config",
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            f"trainer.output_dir={tmp_path / 'r'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "TINKER_API_KEY is not set" in proc.stderr


def test_tinker_preflight_lists_everything_missing_at_once_and_never_the_weights(tmp_path):
    """gsm8k offline, no key, no local copy of the 8B model: one refusal naming the key, the tokenizer (not the
    weights: they stay on Tinker) and the data, within seconds."""
    env = {k: v for k, v in os.environ.items() if k != "TINKER_API_KEY"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    argv = [
        "bash",
        str(ROOT / "launch.sh"),
        "gsm8k",
        "--backend",
        "tinker",
        f"trainer.output_dir={tmp_path / 'r'}",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "TINKER_API_KEY is not set" in err and "tinker.tokenizer" in err and "GSM8K data" in err, err
    assert "config.json" not in err and "safetensors" not in err
    assert not (tmp_path / "r").exists(), "a refused launch must leave no run folder"


def test_local_path_runs_without_tinker_installed(tmp_path):
    """Block `import tinker` in a fresh interpreter; the local trainer, gateway app and launcher still work."""
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "tinker" or name.startswith("tinker."):
            raise ImportError("tinker is not installed")
sys.meta_path.insert(0, Block())
import json
from trainer.training.config import RunConfig, load_config
from trainer.backends.build import build_backend
import inference.app, inference.__main__, trainer.orchestration.launcher, trainer.readout.report
from trainer.training.batch import convert_batch, IntakeOptions
from trainer.training.loss_params import LossParams
from trainer.training.schedule import adam_params
cfg = load_config(RunConfig, {str(ROOT / "configs" / "tiny_cpu.yaml")!r}, ["trainer.output_dir={tmp_path}"])
backend = build_backend(cfg)
ex = convert_batch(json.load(open({str(FIXTURE)!r}))["batch"], IntakeOptions(2048, 64)).examples
fb, optim = backend.train_step(ex, LossParams("importance_sampling"), "sum", adam_params(1e-2))
backend.save_for_sampler(1)
assert "tinker" not in sys.modules
print("ok", optim["optim/grad_norm"])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.slow
def test_launch_toy_with_the_tinker_backend(fake_root):
    run_dir = fake_root / "run"
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "launch.sh"),
            "toy",
            "--backend",
            "tinker",
            "--config",
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            FACTORY,
            "rollout.num_steps=6",
            f"trainer.output_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[-1]["policy_version"] >= 3
    trained = [r for r in rows if r["loss"] is not None]
    assert all(r["importance/logprob_diff_mean"] is not None for r in trained)
    assert json.loads((run_dir / "pids.json").read_text())["vllm"] is None  # no vLLM: Tinker samples
    assert "python -m trainer report" in proc.stdout


@pytest.mark.skipif(
    not os.environ.get("TINKER_API_KEY"), reason="live Tinker smoke test needs TINKER_API_KEY"
)
def test_live_tinker_smoke(tmp_path, examples):
    """One real forward_backward + optim_step + sampler save on Tinker's smallest supported model."""
    from transformers import AutoTokenizer

    model = os.environ.get("TINKER_SMOKE_MODEL", "meta-llama/Llama-3.2-1B")
    cfg = load_config(
        RunConfig,
        None,
        [f"model.path={model}", "lora.rank=8", f"trainer.output_dir={tmp_path}", "launch.backend=tinker"],
    )
    backend = TinkerBackend(cfg, tokenizer=AutoTokenizer.from_pretrained(model))
    fb, optim = backend.train_step(examples[:2], LossParams("cross_entropy"), "sum", adam_params(1e-5))
    assert fb.trainer_logprobs and optim["optim/lr"] == 1e-5
    assert backend.save_for_sampler(1).startswith("tinker://")
