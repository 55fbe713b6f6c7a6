"""The srun line of every component in a GPU job: the gateway and the trainer share the job's GPUs on the first node,
run-api and environment workers ask for no GPU and one CPU, and no step reserves memory another could wait for.
(tests/integration/test_slurm_launch.py runs these lines on a real single-node cluster; it is slow.)"""

from __future__ import annotations

from pathlib import Path

from trainer.orchestration.commands import build_components
from trainer.orchestration.launcher import place_on_slurm
from trainer.orchestration.slurm import SlurmJob, srun_prefix
from trainer.training.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
GPU_OPTIONS = ("--gpus", "--gpus-per-node", "--gpus-per-task", "--gres", "--exact", "--cpus-per-task")


def options(argv: list[str]) -> dict[str, str]:
    """srun's own `--key=value` options (up to the command it runs) as a dict; bare flags map to ''."""
    out: dict[str, str] = {}
    for arg in argv[1:]:
        if not arg.startswith("--"):
            break
        key, _, value = arg.partition("=")
        out[key] = value
    return out


def test_gpu_free_steps_name_zero_gpus_one_cpu_and_reserve_no_memory():
    expected = [
        "srun",
        "--jobid=42",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--mem=0",
        "--exact",
        "--cpus-per-task=1",
        "--gpus=0",
        "--gpus-per-node=0",
        "--nodelist=gpu01",
    ]
    for name in ("run-api", "env", "env-3"):
        argv = srun_prefix(name, ["gpu01"], 42)
        assert argv[: len(expected)] == expected, name
        assert argv[len(expected) :] == [
            f"--job-name={name}",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            "--unbuffered",
        ]
        # Never --gres=none: Slurm < 23.02.5 appends the job's inherited gres:gpu:N to it and refuses the step.
        assert not any(a.startswith("--gres") for a in argv)


def test_gpu_steps_inherit_the_jobs_gpus_and_cpus():
    """No GPU or CPU option at all: the step gets every GPU and CPU the job holds on its nodes, shared with the
    other steps through --overlap."""
    for name, hosts in (("gateway", ["gpu01"]), ("trainer", ["gpu01", "gpu02"])):
        opts = options(srun_prefix(name, hosts, 7))
        assert "--overlap" in opts and opts["--mem"] == "0", name
        assert not set(GPU_OPTIONS) & set(opts), (name, opts)
        assert opts["--nodes"] == opts["--ntasks"] == str(len(hosts))


def test_a_two_node_gpu_job_places_every_step(tmp_path):
    """The launcher's lines for a trainer on both nodes of a 2-node job with 4 GPUs per node: vLLM (the gateway) and
    the trainer's first ranks on gpu01's GPUs, run-api and the environment workers there with none."""
    cfg = load_config(
        RunConfig,
        ROOT / "configs" / "gsm8k.yaml",
        ["rollout.env_workers=2", "distributed.nproc_per_node=4", "distributed.nnodes=2"],
    )
    placement, _ = place_on_slurm(cfg, SlurmJob(9001, ["gpu01", "gpu02"]))
    lines = {c.name: options(c.argv) for c in build_components(cfg, tmp_path, "/m", placement, 9001)}
    assert set(lines) == {"run-api", "gateway", "env-0", "env-1", "trainer"}
    assert lines["gateway"]["--nodelist"] == "gpu01" and lines["trainer"]["--nodelist"] == "gpu01,gpu02"
    assert lines["run-api"]["--nodelist"] == "gpu01"
    assert lines["env-0"]["--nodelist"] == lines["env-1"]["--nodelist"] == "gpu01"
    for name in ("gateway", "trainer"):
        assert not set(GPU_OPTIONS) & set(lines[name]), name
    for name in ("run-api", "env-0", "env-1"):
        assert (lines[name]["--gpus"], lines[name]["--gpus-per-node"]) == ("0", "0"), name
        assert lines[name]["--cpus-per-task"] == "1" and "--exact" in lines[name], name
    assert all(opts["--mem"] == "0" and "--overlap" in opts for opts in lines.values())


def test_environment_workers_on_nodes_the_trainer_leaves_free(tmp_path):
    cfg = load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml", ["rollout.env_workers=2"])
    placement, _ = place_on_slurm(cfg, SlurmJob(9002, ["gpu01", "gpu02"]))
    lines = {c.name: options(c.argv) for c in build_components(cfg, tmp_path, "/m", placement, 9002)}
    assert lines["env-0"]["--nodelist"] == lines["env-1"]["--nodelist"] == "gpu02"
    assert lines["env-0"]["--gpus-per-node"] == "0"
