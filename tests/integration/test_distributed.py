"""Data-parallel training: shard math, and 2 gloo ranks giving the same update as 1 rank on the same batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from trainer.backends.collectives import shard_indices
from trainer.training.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
# No server: runs beside the servers' tests (tests/run.sh).
pytestmark = pytest.mark.beside_servers


@pytest.mark.parametrize(
    "lengths,world",
    [([30] * 12, 2), ([5, 100, 5, 5, 5, 80], 3), ([7, 9], 2), ([1] * 7, 4), ([10, 10, 10], 3)],
)
def test_shards_cover_every_example_once_in_order(lengths, world):
    shards = [shard_indices(lengths, r, world) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(len(lengths)))
    assert all(s for s in shards), "every rank gets an example when there are enough"


def test_shards_balance_tokens():
    lengths = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    shards = [shard_indices(lengths, r, 2) for r in range(2)]
    tokens = [sum(lengths[i] for i in s) for s in shards]
    assert tokens == [100, 100]


def test_fewer_examples_than_ranks_leaves_later_ranks_empty():
    assert [shard_indices([50], r, 3) for r in range(3)] == [[0], [], []]


def test_tinker_backend_refuses_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"launch\.backend=local"):
        load_config(RunConfig, None, ["launch.backend=tinker", "distributed.nproc_per_node=2"])


def run_ranks(out: Path, nproc: int, micro_batch_tokens: int) -> list[dict]:
    out.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(ROOT / "tests" / "dist_step.py"),
            str(out),
            str(micro_batch_tokens),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("micro_batch_tokens", [64, 4096])
def test_two_gloo_ranks_make_the_same_update_as_one(tmp_path, micro_batch_tokens):
    """Three AdamW steps (lr 1e-2, clip 1.0) on the fixture batch: the whole batch, reversed (other shards), then
    one example (rank 1 has nothing and joins the all-reduce with zero weight). Tolerance: every LoRA tensor
    within 1e-4 relative (Frobenius) and every element within 1e-4 absolute, i.e. 1% of one lr=1e-2 Adam step
    (measured: 1.4e-5 and 2.2e-5; summation order differs between 1 and 2 ranks, and Adam magnifies rounding on
    near-zero gradients). Loss and grad norm within 1e-5 relative. Grad norm is what catches a mean-instead-of-sum
    all-reduce: Adam itself is nearly scale-invariant."""
    one = run_ranks(tmp_path / "one", 1, micro_batch_tokens)
    two = run_ranks(tmp_path / "two", 2, micro_batch_tokens)
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), step
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), step
        assert b["metrics"]["tokens/trained"] == a["metrics"]["tokens/trained"]
        assert b["metrics"]["importance/ratio_mean"] == pytest.approx(
            a["metrics"]["importance/ratio_mean"], rel=1e-5
        )
        diffs = [
            abs(p - q)
            for x, y in zip(a["trainer_logprobs"], b["trainer_logprobs"], strict=True)
            for p, q in zip(x, y, strict=True)
        ]
        assert max(diffs) < 1e-5, step
    w1, w2 = (
        load_file(str(tmp_path / "one" / "lora.safetensors")),
        load_file(str(tmp_path / "two" / "lora.safetensors")),
    )
    assert w1.keys() == w2.keys() and any("lora_A" in k for k in w1)
    moved = max(float(t.abs().max()) for k, t in w1.items() if "lora_B" in k)
    assert moved > 1e-2, "the steps must move the adapter for the comparison to mean anything"
    assert max(float((w1[k] - w2[k]).norm() / w1[k].norm()) for k in w1) < 1e-4
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-4


def test_ddp_start_syncs_only_the_adapter_and_refuses_a_different_base(tmp_path):
    """2 gloo ranks, adapters seeded differently (tests/dist_sync.py). DDP's one construction-time broadcast carries
    the LoRA weights alone (the frozen base, 16 GB for an 8B model, stays out), after which both ranks hold rank 0's
    adapter; a rank whose frozen base differs is refused on both ranks, naming the tensor."""
    out = tmp_path / "sync"
    out.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "tests" / "dist_sync.py"),
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads((out / "results.json").read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["frozen_numel"] > 10 * r["trainable_numel"] > 0
        assert [c["numel"] for c in r["sync_calls"]] == [r["trainable_numel"]], (
            "one broadcast, LoRA weights only"
        )
        assert r["trainable_ignored"] == [] and r["frozen_not_ignored"] == []
    before = [r["sync_calls"][0]["before"] for r in ranks]
    assert before[0] != pytest.approx(before[1], rel=1e-6), "seeds must differ for the check to mean anything"
    assert ranks[0]["lora_sum"] == ranks[1]["lora_sum"] == ranks[0]["sync_calls"][0]["before"]
    for r in ranks:
        assert (
            r["mismatch_error"] and "rank 1's frozen base model differs from rank 0's" in r["mismatch_error"]
        )
        assert "embed_tokens" in r["mismatch_error"]


def test_backend_flag_goes_through_the_same_validation(capsys):
    from trainer.orchestration.launcher import main

    assert (
        main(
            [
                "toy",
                "--config",
                str(ROOT / "configs" / "tiny_cpu.yaml"),
                "--backend",
                "tinker",
                "distributed.nproc_per_node=2",
                "--dry-run",
            ]
        )
        == 2
    )
    assert "launch.backend=local" in capsys.readouterr().err


def test_a_trainer_across_nodes_outside_slurm_is_refused(capsys):
    from trainer.orchestration.launcher import main

    assert (
        main(
            ["toy", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "distributed.nnodes=2", "--dry-run"]
        )
        == 2
    )
    assert "needs SLURM" in capsys.readouterr().err
