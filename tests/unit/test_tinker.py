"""The Tinker backend against a fake of the SDK boundary made of real tinker types (tests/fake_tinker.py), the
clear-error cases, the gateway's Tinker sampler, the local path without tinker installed, the comparison report,
and a full `launch.sh toy --backend tinker` run. A live smoke test runs only when TINKER_API_KEY is set."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the tinker extra is not installed")

from inference.app import create_app  # noqa: E402
from inference.config import GatewayConfig  # noqa: E402
from inference.policy.registry import PolicyRegistry  # noqa: E402
from inference.samplers.tinker import TinkerSamplingBackend  # noqa: E402
from tests.fake_tinker import make_service_client  # noqa: E402
from tests.helpers import FIXTURE, trained_token_logprobs  # noqa: E402
from trainer.backends.tinker import TinkerBackend, wait  # noqa: E402
from trainer.training.batch import IntakeOptions, convert_batch  # noqa: E402
from trainer.training.config import ConfigError, RunConfig, load_config  # noqa: E402
from trainer.training.loss_params import LossParams  # noqa: E402
from trainer.training.losses import BatchScale  # noqa: E402
from trainer.training.schedule import adam_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tinker.client_factory=tests.fake_tinker:make_service_client"


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TINKER_ROOT", str(tmp_path / "tinker"))
    return tmp_path


def tiny_cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(
        RunConfig,
        ROOT / "configs" / "tiny_cpu.yaml",
        [f"trainer.output_dir={tmp_path / 'run'}", "launch.backend=tinker", *overrides],
    )


@pytest.fixture(scope="module")
def examples():
    return convert_batch(json.loads(FIXTURE.read_text())["batch"], IntakeOptions(2048, 64)).examples


@pytest.mark.parametrize(
    "name,reduction",
    [
        ("importance_sampling", "sum"),
        ("ppo", "seq_mean_token_sum"),
        ("cispo", "token_mean"),
        ("grpo", "seq_mean_token_mean"),
        ("cross_entropy", "token_mean"),
        ("grpo", "seq_mean_token_sum+scale"),
    ],
)
def test_tinker_path_gives_the_local_loss_and_gradients(fake_root, examples, tokenizer_path, name, reduction):
    """Tinker only sums; reductions ride on scaled advantages/weights. Same loss, same gradients, also when the
    batch scale counts zero-variance sequences that are not sent."""
    from transformers import AutoTokenizer

    from trainer.backends.local import LocalBackend

    remote = TinkerBackend(
        tiny_cfg(fake_root, FACTORY), tokenizer=AutoTokenizer.from_pretrained(tokenizer_path)
    )
    local = LocalBackend(
        load_config(
            RunConfig, ROOT / "configs" / "tiny_cpu.yaml", [f"trainer.output_dir={fake_root / 'local'}"]
        )
    )
    reduction, _, scaled = reduction.partition("+")
    scale = BatchScale(len(examples) + 5, sum(sum(e.loss_mask) for e in examples) + 37) if scaled else None
    a = remote.forward_backward(examples, LossParams(name), reduction, scale)
    b = local.forward_backward(examples, LossParams(name), reduction, scale)
    assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-6)
    assert a.metrics["importance/logprob_diff_mean"] == pytest.approx(
        b.metrics["importance/logprob_diff_mean"]
    )
    remote_grads = {n: p.grad for n, p in remote.client.backend.model.named_parameters() if p.requires_grad}
    for n, p in local.model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(remote_grads[n], p.grad, atol=1e-6), n


def test_gspo_datums_mark_the_trained_tokens_for_the_sequence_ratio(examples):
    from trainer.backends.tinker import build_datums, loss_fn_config
    from trainer.training.batch import examples_to_tensors
    from trainer.training.losses import compute_reduction_weights

    tensors = examples_to_tensors(list(examples[:3]))
    weights_BT = compute_reduction_weights(tensors["mask_BT"], "sum", 0.0, 0)
    datums = build_datums(examples[:3], LossParams("gspo"), weights_BT, tensors)
    for example, datum in zip(examples[:3], datums, strict=True):
        mask = datum.loss_fn_inputs["sequence_ratio_mask"].tolist()
        assert mask == [float(m != 0) for m in example.loss_mask] and 0 < sum(mask) < len(mask)
    assert loss_fn_config(LossParams("gspo")) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert (
        "sequence_ratio_mask"
        not in build_datums(examples[:1], LossParams("ppo"), weights_BT, tensors)[0].loss_fn_inputs
    )


def test_a_teacher_on_tinker_scores_the_trained_tokens_and_distillation_trains(
    fake_root, examples, tokenizer_path
):
    """distill.teacher with --backend tinker: a base model Tinker serves (and a sampler checkpoint by its tinker://
    path), scored by compute_logprobs; the logprobs are a float64 forward's, and a distillation step trains."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.backends.local import resolve_model_path
    from trainer.training.backend import TeacherScoring
    from trainer.training.distill import distill_examples

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    backend = TinkerBackend(tiny_cfg(fake_root, FACTORY, "distill.teacher=tiny"), tokenizer=tok)
    backend.load_teacher("tiny")
    assert isinstance(backend, TeacherScoring)
    got = backend.teacher_logprobs(examples)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"), dtype=torch.float64).eval()
    for row, want in zip(got, trained_token_logprobs(model, examples), strict=True):
        assert row == pytest.approx(want, abs=1e-4)
    distilled, metrics = distill_examples(examples, got, kl_coef=1.0, reward_coef=0.0)
    assert metrics["distill/tokens_scored"] > 0
    _, optim = backend.train_step(distilled, LossParams("importance_sampling"), "sum", adam_params(1e-2))
    assert optim["optim/grad_norm"] > 0
    # A sampler checkpoint of this run as the teacher: its tinker:// path, scored like the base.
    path = backend.save_for_sampler(1)
    backend.load_teacher(path)
    assert backend.teacher_logprobs(examples[:1])[0] != got[0]


def test_a_local_teacher_is_refused_with_the_tinker_backend(tmp_path):
    for local in (str(tmp_path), "./teacher", "http://127.0.0.1:8000"):
        with pytest.raises(ValueError, match="the teacher must live on Tinker"):
            tiny_cfg(tmp_path, f"distill.teacher={local}")
    assert tiny_cfg(tmp_path, "distill.teacher=tinker://run/sampler_weights/v1").distill.teacher


def test_train_step_save_and_resume(fake_root, examples, tokenizer_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    cfg = tiny_cfg(fake_root, FACTORY)
    backend = TinkerBackend(cfg, tokenizer=tok)
    fb, optim = backend.train_step(examples, LossParams("importance_sampling"), "sum", adam_params(1e-2))
    assert optim["optim/grad_norm"] > 0 and backend.step == 1 and fb.trainer_logprobs
    assert backend.save_for_sampler(1).startswith("tinker://")
    ckpt = backend.save_state("step-000001")
    resumed = TinkerBackend(cfg, tokenizer=tok)
    resumed.load_state(ckpt)
    assert resumed.step == 1
    w_a = {n: p for n, p in backend.client.backend.model.named_parameters() if p.requires_grad}
    for n, p in resumed.client.backend.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, w_a[n])
    with pytest.raises(ConfigError, match="no Tinker equivalent"):
        backend.forward_backward(examples, LossParams("dro"))
    with pytest.raises(ConfigError, match="tis_cap"):
        backend.forward_backward(examples, LossParams("importance_sampling", tis_cap=2.0))


@pytest.mark.parametrize(
    "key,needle", [(None, "TINKER_API_KEY is not set"), ("sk-123", "does not look like")]
)
def test_key_errors_are_immediate(tmp_path, monkeypatch, key, needle):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    if key:
        monkeypatch.setenv("TINKER_API_KEY", key)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=needle):
        TinkerBackend(tiny_cfg(tmp_path))
    assert time.monotonic() - started < 5


def test_unsupported_base_model_lists_the_supported(fake_root):
    with pytest.raises(ConfigError, match=r"not a base model Tinker can train; supported: \['tiny'\]"):
        TinkerBackend(tiny_cfg(fake_root, FACTORY, "model.path=meta-llama/NotAModel"))


def test_a_silent_service_times_out_with_a_message():
    never: Future = Future()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer forward_backward within 1s"):
        wait(never, 1.0, "forward_backward")
    assert time.monotonic() - started < 3


@pytest.fixture(scope="module")
def tokenizer_path(tiny_model_path):
    return tiny_model_path


async def test_gateway_serves_from_tinker_sampling_clients(fake_root, tokenizer_path):
    from transformers import AutoTokenizer

    from trainer.backends.local import LocalBackend

    cfg = tiny_cfg(fake_root, FACTORY)
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    gateway_cfg = GatewayConfig.model_validate(cfg.inference)
    backend = TinkerSamplingBackend(gateway_cfg, "tiny", tok, make_service_client, timeout_s=60)
    registry = PolicyRegistry(gateway_cfg.served_model_name, 2)
    app = create_app(gateway_cfg, backend, registry, vocab_size=len(tok), start_backend=False)
    await backend.start()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120
    ) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.post(
            "/generate", json={"prompt": {"prompt_token_ids": [5, 6, 7]}, "n": 3, "max_tokens": 4}
        )
        body = r.json()
        assert r.status_code == 200 and body["finish_reasons"] == ["length"] * 3
        assert all(len(seq) == 4 for seq in body["logprobs"])
        eos = tok.eos_token_id
        r = await c.post(
            "/generate",
            json={
                "input_ids": [5, 6],
                "sampling_params": {"n": 2, "max_new_tokens": 3, "stop_token_ids": list(range(2048))},
            },
        )  # every token stops: honest "stop"
        assert [x["meta_info"]["finish_reason"]["type"] for x in r.json()] == ["stop", "stop"]
        r = await c.post("/generate", json={"prompt": {"prompt_token_ids": [5]}, "min_p": 0.1})
        assert r.status_code == 400 and "not supported by the Tinker sampler" in r.text
        # publish a trained adapter by its tinker:// path
        local = LocalBackend(
            load_config(
                RunConfig, ROOT / "configs" / "tiny_cpu.yaml", [f"trainer.output_dir={fake_root / 'pub'}"]
            )
        )
        path = "tinker://fake" + local.save_for_sampler(1)
        bad = await c.post("/policy/publish", json={"version": 1, "adapter_path": "/local/folder"})
        assert bad.status_code == 400 and "tinker://" in bad.text
        ok = await c.post("/policy/publish", json={"version": 1, "adapter_path": path})
        assert ok.status_code == 200, ok.text
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "n": 2},
        )
        chat = r.json()
        assert r.headers["x-policy-version"] == "1" and len(chat["choices"]) == 2
        assert len(chat["choices"][0]["logprobs"]["content"]) == len(chat["choices"][0]["token_ids"])
        r = await c.post("/v1/completions", json={"prompt": "Ann has", "max_tokens": 2, "logprobs": 1})
        assert r.json()["choices"][0]["logprobs"]["token_logprobs"] and eos is not None
    await backend.stop()


def make_run(folder: Path, backend: str, rewards: list[float]) -> Path:
    folder.mkdir(parents=True)
    cfg = {
        "launch": {"backend": backend},
        "model": {"path": "tiny"},
        "pricing": {
            "tinker_sample_usd_per_mtok": 1.0,
            "tinker_train_usd_per_mtok": 2.0,
            "local_gpu_usd_per_hour": 3.6,
        },
    }
    (folder / "config.yaml").write_text(json.dumps(cfg))
    rows = [
        {
            "step": i + 1,
            "policy_version": i + 1,
            "reward/mean": r,
            "time/step_s": 2.0,
            "tokens/sampled": 1000.0,
            "tokens/trained": 500.0,
            "importance/logprob_diff_mean": 1e-3,
            "wall_s": 2.0 * (i + 1),
        }
        for i, r in enumerate(rewards)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_report_compares_runs(tmp_path):
    from trainer.readout.report import main

    a = make_run(tmp_path / "local-run", "local", [0.1, 0.5, 0.9, 1.0])
    b = make_run(tmp_path / "tinker-run", "tinker", [0.1, 0.2, 0.3, 0.85])
    assert main([str(a), str(b), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| local-run | local | tiny | 4 |" in report and "| tinker-run | tinker |" in report
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary[0]["cost_usd"] == pytest.approx(8.0 / 3600 * 3.6)
    assert summary[1]["cost_usd"] == pytest.approx((4000 * 1.0 + 2000 * 2.0) / 1e6)
    assert summary[0]["wall_s_to_reward_0.8"] == 6.0 and summary[1]["wall_s_to_reward_0.8"] == 8.0
    for png in ("reward_per_step.png", "reward_over_wall_clock.png", "step_time.png", "logprob_diff.png"):
        data = (tmp_path / "report" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_an_unpriced_run_has_no_cost_rather_than_zero(tmp_path):
    from trainer.readout.report import main

    a = make_run(tmp_path / "local-run", "local", [0.1, 0.5])
    config = json.loads((a / "config.yaml").read_text())  # JSON is YAML
    config.pop("pricing")
    (a / "config.yaml").write_text(json.dumps(config))
    assert main([str(a), str(a), "--out", str(tmp_path / "report")]) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary[0]["cost_usd"] is None
    assert "| local-run | local | tiny | 2 |" in (tmp_path / "report" / "report.md").read_text()
