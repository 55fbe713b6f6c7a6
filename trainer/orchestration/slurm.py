"""Placement of the run's components inside a SLURM allocation (`sbatch launch.sh ...`).

Pure planning plus two reads of SLURM itself (`scontrol show hostnames` for the node list). The launcher turns
each placement into an `srun` step that runs concurrently with the others (`--overlap`), so SLURM owns the
processes on every node, accounts for them, and kills them all when the job ends.

Layout: run-api, the gateway and its vLLM replicas on the first node; the trainer on the first
`distributed.nnodes` nodes (torchrun, one rank per GPU); environment workers on the nodes the trainer does not
use, or on the first node when there are none. Ports are derived from the job id, so two jobs sharing a node do
not collide and every node can compute them without talking to the others. GPUs: the gateway and the trainer
share every GPU the job holds on their nodes; run-api and environment workers take none (see srun_prefix).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer.training.config import ConfigError, RunConfig

PORT_BASE = 20000
PORTS_PER_JOB = 4  # run-api, gateway, torchrun rendezvous, one spare
JOB_SLOTS = 10000  # ports PORT_BASE .. PORT_BASE + JOB_SLOTS * PORTS_PER_JOB (= 60000)


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    hosts: list[str]


@dataclass(frozen=True)
class Ports:
    run_api: int
    gateway: int
    rendezvous: int


@dataclass
class Placement:
    """Where each component runs: host lists by component name, plus the addresses everything dials."""

    hosts: dict[str, list[str]] = field(default_factory=dict)
    bind_host: str = "0.0.0.0"
    connect_host: str = ""
    ports: Ports = Ports(0, 0, 0)


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a SLURM node list (`gpu[01-03],cpu7`), as `scontrol show hostnames` prints them."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except FileNotFoundError:
        raise ConfigError(
            "scontrol is not on PATH: run under SLURM (sbatch launch.sh ...) on a node with the "
            "SLURM client tools"
        ) from None
    except subprocess.CalledProcessError as exc:
        raise ConfigError(f"scontrol show hostnames {nodelist!r} failed: {exc.stderr.strip()}") from None
    hosts = out.split()
    if not hosts:
        raise ConfigError(f"node list {nodelist!r} names no hosts")
    return hosts


def parse_nodelist(nodelist: str) -> list[str]:
    """Offline expansion of a node list for previews (`--dry-run --slurm-nodes`), where no SLURM controller may be
    reachable: `gpu[01-03,7],cpu1` -> gpu01 gpu02 gpu03 gpu7 cpu1 (each range keeps its own zero padding, as
    scontrol does). Inside a job, expand_nodelist asks scontrol itself."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item, nodelist))
    if not hosts:
        raise ConfigError(f"node list {nodelist!r} names no hosts")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [i.strip() for i in [*items, current] if i.strip()]


def _expand_item(item: str, whole: str) -> list[str]:
    if "[" not in item:
        return [item]
    head, _, rest = item.partition("[")
    ranges, sep, tail = rest.partition("]")
    if not sep or not ranges:
        raise ConfigError(f"node list {whole!r}: unbalanced brackets in {item!r}")
    names: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"node list {whole!r}: {part!r} is not a number or a range like 01-04")
        width = len(lo)
        names.extend(f"{head}{n:0{width}d}" for n in range(int(lo), int(hi or lo) + 1))
    return [n + t for n in names for t in _expand_item(tail, whole)] if tail else names


def job_from_env(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The SLURM job this process runs in, or None outside SLURM."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(f"SLURM_JOB_ID={env['SLURM_JOB_ID']} but SLURM_JOB_NODELIST is not set")
    return SlurmJob(int(env["SLURM_JOB_ID"]), expand_nodelist(nodelist))


def derive_ports(job_id: int, base: int = PORT_BASE) -> Ports:
    first = base + (job_id % JOB_SLOTS) * PORTS_PER_JOB
    return Ports(run_api=first, gateway=first + 1, rendezvous=first + 2)


def plan(cfg: RunConfig, job: SlurmJob) -> Placement:
    hosts = job.hosts
    nnodes = cfg.distributed.nnodes
    if nnodes > len(hosts):
        raise ConfigError(
            f"distributed.nnodes={nnodes} but the job has {len(hosts)} node(s) ({','.join(hosts)}); "
            f"submit with --nodes={nnodes} or more"
        )
    bind = cfg.launch.slurm_bind_host
    loopback = bind in ("127.0.0.1", "localhost", "::1")
    if loopback and len(hosts) > 1:
        raise ConfigError(
            f"launch.slurm_bind_host={bind!r} with {len(hosts)} nodes: the other nodes could not reach "
            "run-api and the gateway; use 0.0.0.0 (the default)"
        )
    head = hosts[0]
    env_hosts = hosts[nnodes:] or [head]
    placement = Placement(
        bind_host=bind,
        connect_host="127.0.0.1" if loopback else head,
        ports=derive_ports(job.job_id, cfg.launch.slurm_port_base),
    )
    placement.hosts["run-api"] = [head]
    placement.hosts["gateway"] = [head]  # vLLM replicas are the gateway's children: same node
    for i, (name, _, _) in enumerate(cfg.rollout.env_processes()):
        placement.hosts[name] = [env_hosts[i % len(env_hosts)]]
    placement.hosts["trainer"] = hosts[:nnodes]
    return placement


# The steps that use GPUs. Every other component (run-api: HTTP and queues; environment workers: prompts, rewards,
# tokenising) is one Python process that never touches a GPU.
GPU_STEPS = frozenset({"gateway", "trainer"})
GPU_FREE_STEP_CPUS = 1


def step_resources(name: str) -> list[str]:
    """srun options for what one component's step may use of the job.

    Every step: --mem=0, i.e. it may use all of the job's memory on its node but reserves none of it, so no step
    waits for memory another holds (on Slurm < 22.05 --overlap shares CPUs only).

    The gateway and the trainer ask for no GPUs, so they inherit every GPU the job holds on their nodes (srun reads
    the job's SLURM_GPUS_PER_NODE; slurmctld copies the job's GRES to a step that names none), and --overlap lets
    the two steps hold the same GPUs at once (Slurm >= 22.05; before, --overlap shared CPUs only and the trainer's
    step would wait for the gateway's GPU). That is what the memory plan assumes: vLLM and the trainer's first
    ranks on the first node's GPUs.

    A GPU-free step would otherwise inherit the same request. It names the two GPU options sbatch exports
    (SLURM_GPUS, SLURM_GPUS_PER_NODE, which srun reads) with a count of 0: an option on the command line
    overrides its environment variable, a step naming any GPU count no longer inherits the job's GRES, and
    zero-count GRES are dropped, all the way back to Slurm 21.08 and on clusters without GPU GRES. Not
    `--gres=none`: before Slurm 23.02.5 srun appends the inherited `gres:gpu:N` to it, and slurmctld refuses
    the step ("Invalid Trackable RESource (TRES) specification"). Not `--gpus=0` alone: before 24.11 it leaves
    the inherited --gpus-per-node in place. (A job that asks its GPUs with --gpus-per-task is not covered; the
    launcher's #SBATCH header uses --gpus-per-node.) --exact with --cpus-per-task limits it to one CPU; with
    --overlap that CPU stays usable by the other steps too."""
    if name in GPU_STEPS:
        return ["--mem=0"]
    return [
        "--mem=0",
        "--exact",
        f"--cpus-per-task={GPU_FREE_STEP_CPUS}",
        "--gpus=0",
        "--gpus-per-node=0",
    ]


def srun_prefix(name: str, hosts: list[str], job_id: int) -> list[str]:
    """An srun step for one component: one task per host, running beside the other steps (--overlap) instead of
    waiting for their resources, with the GPUs, CPUs and memory of step_resources, and the whole step torn down
    if any of its tasks fails."""
    return [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        f"--nodes={len(hosts)}",
        f"--ntasks={len(hosts)}",
        "--ntasks-per-node=1",
        *step_resources(name),
        f"--nodelist={','.join(hosts)}",
        f"--job-name={name}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--unbuffered",
    ]
