"""The sections of the processes around the trainer: the launcher (and a run attached to an engine), Tinker, the
local Tinker-protocol service, and the prices a report costs a run at."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlcommon.hosts import LOOPBACK_HOSTS
from trainer.training.config_base import Section


class TinkerConfig(Section):
    timeout_s: float = Field(60.0, gt=0, description="deadline for any single Tinker call, seconds")
    tokenizer: str | None = Field(None, description="tokenizer (hub id or folder); None = model.path")
    client_factory: str | None = Field(
        None,
        description="'module:function' returning a ServiceClient-like object (proxies, tests); None = tinker's",
    )


class PricingConfig(Section):
    """Prices the comparison report uses to estimate cost; edit them to your contract."""

    tinker_sample_usd_per_mtok: float = Field(
        0.0, ge=0, description="Tinker sampling price, USD per 1M tokens"
    )
    tinker_train_usd_per_mtok: float = Field(
        0.0, ge=0, description="Tinker training price, USD per 1M tokens"
    )
    local_gpu_usd_per_hour: float = Field(0.0, ge=0, description="what the local GPU box costs per hour, USD")


class EngineAttachKeys(Section):
    """Keys of a run's `inference:` section that are the run's, not its gateway's: they attach the run to a shared
    engine (launch.sh engine; trainer/orchestration/attach.py) and never reach a gateway.yaml."""

    engine_url: str | None = Field(
        None,
        description="a shared engine's URL (launch.sh engine): the run starts no gateway or vLLM of its own and "
        "holds the engine through a lease",
    )
    engine_lease: str | None = Field(
        None, description="set by the launcher: the run's lease id on the engine (a resumed run keeps it)"
    )


ENGINE_KEYS = tuple(EngineAttachKeys.model_fields)


class LaunchConfig(Section):
    backend: Literal["local", "tinker"] = Field(
        "local", description="who trains and samples: this box or Tinker"
    )
    run_api_port: int = Field(0, ge=0, lt=65536, description="Atropos run-api port; 0 = a free one")
    run_api_url: str | None = Field(None, description="set by the launcher once run-api is up")
    gateway_url: str | None = Field(None, description="set by the launcher once the gateway is healthy")
    dashboard: bool = Field(
        False,
        description="serve the live dashboard of this run on 127.0.0.1 (a free port; its URL is printed)",
    )
    health_timeout_s: float = Field(600.0, gt=0, description="deadline for each component to become healthy")
    idle_warn_s: float = Field(
        180.0,
        ge=0,
        description="print why the run is idle after this many seconds without a training step (repeated as "
        "long as it lasts); 0 = never",
    )
    wandb: bool = Field(
        False,
        description="also log the trainer's, the environments' and the evaluations' metrics to Weights & Biases, "
        "one group per run; online with a W&B login, else offline, unless WANDB_MODE says",
    )
    wandb_project: str = Field("rl-lora", description="W&B project")
    slurm_bind_host: str = Field(
        "0.0.0.0",
        description="under SLURM: address run-api and the gateway bind (other nodes must reach them)",
    )
    max_restarts_per_hour: int = Field(
        10,
        ge=0,
        description="restarts of each component (trainer, run-api, an environment, the gateway) the launcher "
        "makes within any hour before it gives up and stops the run; 0 = a death ends the run",
    )
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="memory of each GPU for the launcher's memory plan, GiB; None = read from the GPU at launch "
        "(a dry run on a machine without one then prints the plan without checking the fit)",
    )
    slurm_port_base: int = Field(
        20000,
        ge=1024,
        lt=25536,
        description="under SLURM: ports are base + 4 x (job id mod "
        "10000) + 0..2 for run-api, gateway, torchrun rendezvous",
    )


MIN_SERVICE_KEY_CHARS = 20  # tml- and 16 more: a key off loopback


class ServiceConfig(Section):
    """The local Tinker-protocol service (`bash launch.sh service`): the unmodified tinker SDK trains LoRA adapters
    of `model.path` here, several clients on one base."""

    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 exposes it to the network")
    port: int = Field(8100, ge=0, le=65535, description="port to bind (0: any free port, printed at start)")
    output_dir: str = Field(
        "runs/service", description="one folder per training client: metrics.jsonl, states"
    )
    api_key: str | None = Field(
        None, description="when set, the X-API-Key the SDK must send (it always sends one starting tml-)"
    )
    max_clients: int = Field(8, ge=1, description="training clients at once (each holds an adapter and Adam)")
    poll_hold_s: float = Field(
        20.0,
        gt=0,
        lt=45,
        description="how long a retrieve_future poll waits for its result (SDK timeout: 45 s)",
    )
    session_timeout_s: float = Field(
        300.0,
        gt=10,
        description="a session whose SDK sent no heartbeat (every 10 s) for this long is ended: its clients released",
    )
    sampling: bool = Field(
        True,
        description="launch.sh service starts a gateway with vLLM beside the service to sample (false: no vLLM)",
    )
    gateway_url: str | None = Field(
        None,
        description="the gateway that samples (launch.sh service starts one and sets this); None: training only",
    )
    gateway_token: str | None = Field(
        None, description="the gateway's inference.publish_token, when it has one"
    )
    max_loaded_samplers: int = Field(
        8, ge=1, description="sampler adapters kept loaded in vLLM; older ones are loaded again when sampled"
    )
    sampler_snapshots_kept: int = Field(
        8,
        ge=1,
        description="unnamed snapshots (save_weights_and_get_sampling_client) kept per training client; older "
        "ones are deleted",
    )

    @model_validator(mode="after")
    def _key_off_loopback(self) -> ServiceConfig:
        # The gateway and the dashboard refuse an open bind beyond this machine; so does the service.
        if self.host not in LOOPBACK_HOSTS and len(self.api_key or "") < MIN_SERVICE_KEY_CHARS:
            have = (
                "no service.api_key"
                if not self.api_key
                else f"a service.api_key of {len(self.api_key)} characters"
            )
            raise ValueError(
                f"service.host={self.host!r} exposes the service beyond this machine with {have}: set "
                f"service.api_key (tml- and at least {MIN_SERVICE_KEY_CHARS} characters in all, e.g. "
                "tml-$(openssl rand -hex 16)), or keep service.host=127.0.0.1"
            )
        return self
