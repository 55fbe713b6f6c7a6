"""Checks launch.sh runs before starting anything: is the model here (else fetch it from the hub), is the Tinker
key there, does each environment pass its own pre-flight (`python -m environments.NAME preflight`, which checks
its data), is a distillation teacher there and does it share the student's tokenizer, does the config fit its GPU
(trainer/orchestration/memory_plan.py). Each failure says what is missing and how to supply it, within seconds, all
of them at once; only the model download itself takes longer. `preflight()` runs them in that order for a launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from trainer.orchestration.commands import ROOT, env_preflight_command
from trainer.training.config import ConfigError, RunConfig
from trainer.training.distill import resolve_teacher, teacher_kind
from trainer.training.rollout_config import EnvSpec

if TYPE_CHECKING:
    from trainer.orchestration.memory_plan import MemoryPlan

HUB_URL = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*"]
TOKENIZER_FILES = ["tokenizer*", "*.json"]
# Llama repos also carry Meta's own checkpoint (original/consolidated.00.pth, params.json) and Mistral repos a
# consolidated.safetensors: second copies of the weights, in formats neither vLLM nor transformers reads here.
SKIPPED_FILES = ["original/*", "*.pth", "consolidated*"]


def hub_reachable(timeout_s: float = 5.0) -> bool:
    from huggingface_hub import constants

    if constants.is_offline_mode():  # HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, read as the hub library does
        return False
    try:
        httpx.head(HUB_URL, timeout=timeout_s, follow_redirects=True)
        return True
    except httpx.HTTPError:
        return False


@dataclass(frozen=True)
class ModelDownload:
    """A hub model pre-flight will fetch: the files still missing from the cache and their sizes."""

    repo_id: str
    tokenizer_only: bool
    files: dict[str, int]
    cached_files: int
    cache: Path
    free_bytes: int

    @property
    def size_bytes(self) -> int:
        return sum(self.files.values())

    def summary(self) -> str:
        cached = f", {self.cached_files} more already cached" if self.cached_files else ""
        return (
            f"{self.repo_id}: {gb(self.size_bytes)} in {len(self.files)} files{cached}, into {self.cache} "
            f"({gb(self.free_bytes)} free there)"
        )


def gb(nbytes: float) -> str:
    """Decimal units, as the hub shows file sizes (a tokenizer is MBs, a model GBs)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1e3:.2f} kB"


def model_key(path: str, tokenizer_only: bool, setting: str | None = None) -> tuple[str, str]:
    """How a message names the setting (and the key that replaces it with a folder)."""
    if setting is not None:  # another model than the run's own, e.g. distill.teacher
        return f"{setting}={path!r}", setting
    if tokenizer_only:  # Tinker holds the weights: only the tokenizer is read here
        return f"the tokenizer of {path!r} (tinker.tokenizer, default model.path)", "tinker.tokenizer"
    return f"model.path={path!r}", "model.path"


def fetch_command(repo_id: str, tokenizer_only: bool) -> str:
    """The CLI line (huggingface_hub's `hf`) that fetches what pre-flight would, into the same cache."""
    wanted = TOKENIZER_FILES if tokenizer_only else MODEL_FILES
    flags = [f'--include "{p}"' for p in wanted] + [f'--exclude "{p}"' for p in SKIPPED_FILES]
    return f"hf download {repo_id} {' '.join(flags)}"


def missing_files(folder: Path, tokenizer_only: bool) -> list[str]:
    """What a model folder lacks to be served and trained (a cached snapshot may hold config.json alone: the
    memory plan fetches just that)."""
    if tokenizer_only:
        return [] if (folder / "tokenizer_config.json").is_file() else ["tokenizer_config.json"]
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return missing + [s for s in shards if not (folder / s).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def cached_model(repo_id: str, tokenizer_only: bool) -> str | None:
    """The complete snapshot of a hub id in the local Hugging Face cache, or None. Reads only."""
    try:
        from huggingface_hub import snapshot_download

        wanted = TOKENIZER_FILES if tokenizer_only else MODEL_FILES
        folder = snapshot_download(
            repo_id, local_files_only=True, allow_patterns=wanted, ignore_patterns=SKIPPED_FILES
        )
    except Exception:  # not in the cache, or not a repo id (the hub library raises several error types)
        return None
    return None if missing_files(Path(folder), tokenizer_only) else str(folder)


def find_model(path: str, tokenizer_only: bool = False, setting: str | None = None) -> str | ModelDownload:
    """A local folder for the model (building the tiny one if asked), or what must be downloaded for it.
    With `tokenizer_only` (the Tinker backend, whose weights stay remote) a folder holding a tokenizer is enough.
    Raises ConfigError for what no download can fix: a gated model without access, an unknown id, no disk, no
    network."""
    what = "tokenizer" if tokenizer_only else "model"
    from trainer.backends.tiny_model import TINY_NAMES, tiny_model_named

    if path in TINY_NAMES:
        return str(tiny_model_named(path))
    where, key = model_key(path, tokenizer_only, setting)
    if Path(path).is_dir():
        needed = "tokenizer_config.json" if tokenizer_only else "config.json"
        if not (Path(path) / needed).is_file():
            raise ConfigError(f"{what} {path!r} is a folder without {needed}: point it at a HF model folder")
        return str(Path(path).resolve())
    if path.startswith(("/", ".", "~")):  # a hub id never starts so: this was meant as a folder
        raise ConfigError(f"{where}: no such folder; set {key} to a model folder or a hub id (org/name)")
    cached = cached_model(path, tokenizer_only)
    if cached is not None:
        return cached
    if not hub_reachable():
        raise ConfigError(
            f"{where} is not a local folder, is not (complete) in the Hugging Face cache, and the hub ({HUB_URL}) "
            f"is unreachable. Fetch it where there is network with `{fetch_command(path, tokenizer_only)}` (it "
            f"fills the Hugging Face cache: copy that, or point HF_HUB_CACHE at it), or set {key}=/path/to/folder"
        )
    return plan_download(path, tokenizer_only)


def hub_refusal(exc: Exception, repo_id: str, tokenizer_only: bool, gated: bool = False) -> ConfigError:
    """What to tell the user when the hub refuses a repo (gated, unknown) or does not answer. `gated`: the hub
    listed the repo as gated, so any 401/403 on it means no access (not only the error typed as such)."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
    )

    where, key = model_key(repo_id, tokenizer_only)
    denied = (
        isinstance(exc, HfHubHTTPError)
        and exc.response is not None
        and exc.response.status_code in (401, 403)
    )
    if isinstance(exc, GatedRepoError) or (gated and denied):  # GatedRepoError is a RepositoryNotFoundError
        token = (
            "the token found (HF_TOKEN or `hf auth login`) belongs to an account without access"
            if get_token()
            else "no Hugging Face token is set"
        )
        return ConfigError(
            f"{where} is a gated model and {token}. Accept its licence at {HUB_URL}/{repo_id} with your "
            f"Hugging Face account, then set HF_TOKEN=hf_... (a read token of that account) or run "
            f"`hf auth login`, and launch again; or set {key}=/path/to/folder holding the model"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ConfigError(
            f"{where}: there is no such model on the hub ({HUB_URL}/{repo_id}) and no such folder here. Check the "
            "id (org/name, as on its hub page); a private model also needs HF_TOKEN"
        )
    if isinstance(exc, HFValidationError):
        return ConfigError(f"{where} is neither a folder here nor a hub model id (org/name): {exc}")
    return ConfigError(
        f"{where}: the hub ({HUB_URL}) did not answer for it ({type(exc).__name__}: {exc}). Try again, fetch "
        f"it with `{fetch_command(repo_id, tokenizer_only)}`, or set {key}=/path/to/folder"
    )


def existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def plan_download(repo_id: str, tokenizer_only: bool) -> ModelDownload:
    """The files to fetch (the patterns' matches not yet cached) and their size, from the hub's listing; refuses
    a gated model without access and a download that does not fit the cache's disk. Downloads nothing."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi()
    try:
        info = api.model_info(repo_id, files_metadata=True)
    except Exception as exc:  # the hub library's errors (gated, unknown, HTTP, network) each get a message
        raise hub_refusal(exc, repo_id, tokenizer_only) from exc
    if info.gated:  # the listing is public; the files need a token whose account accepted the licence
        try:
            api.auth_check(repo_id)
        except Exception as exc:
            raise hub_refusal(exc, repo_id, tokenizer_only, gated=True) from exc
    wanted = TOKENIZER_FILES if tokenizer_only else MODEL_FILES
    siblings = list(
        filter_repo_objects(
            info.siblings or [],
            allow_patterns=wanted,
            ignore_patterns=SKIPPED_FILES,
            key=lambda s: s.rfilename,
        )
    )
    where, key = model_key(repo_id, tokenizer_only)
    if not tokenizer_only and not any(s.rfilename.endswith(".safetensors") for s in siblings):
        listed = sorted(s.rfilename for s in info.siblings or [])[:12]
        raise ConfigError(
            f"{where}: the hub holds no safetensors weights for it (files: {listed}); choose a model that ships "
            f"safetensors, or set {key} to a folder with the model saved as safetensors"
        )
    cached = {s.rfilename for s in siblings if isinstance(try_to_load_from_cache(repo_id, s.rfilename), str)}
    cache = Path(constants.HF_HUB_CACHE)
    plan = ModelDownload(
        repo_id=repo_id,
        tokenizer_only=tokenizer_only,
        files={s.rfilename: int(s.size or 0) for s in siblings if s.rfilename not in cached},
        cached_files=len(cached),
        cache=cache,
        free_bytes=shutil.disk_usage(existing_parent(cache)).free,
    )
    if plan.size_bytes > plan.free_bytes:
        raise ConfigError(
            f"{where}: downloading it needs {gb(plan.size_bytes)} ({len(plan.files)} files) in {cache}, but only "
            f"{gb(plan.free_bytes)} is free there. Free {gb(plan.size_bytes - plan.free_bytes)} or more, point "
            f"HF_HUB_CACHE (or HF_HOME) at a larger disk, or set {key}=/path/to/folder holding the model"
        )
    return plan


def download_model(plan: ModelDownload) -> str:
    """Fetch the planned files into the Hugging Face cache (huggingface_hub draws the progress; an interrupted
    download continues where it stopped next time) and return the snapshot folder."""
    from huggingface_hub import snapshot_download

    print(f"model: downloading {plan.summary()}", flush=True)
    wanted = TOKENIZER_FILES if plan.tokenizer_only else MODEL_FILES
    try:
        folder = Path(snapshot_download(plan.repo_id, allow_patterns=wanted, ignore_patterns=SKIPPED_FILES))
    except Exception as exc:  # gated/unknown get their own message, the rest (network, disk) how to go on
        from huggingface_hub.errors import RepositoryNotFoundError

        if isinstance(exc, RepositoryNotFoundError):
            raise hub_refusal(exc, plan.repo_id, plan.tokenizer_only) from exc
        raise ConfigError(
            f"downloading {plan.repo_id} stopped ({type(exc).__name__}: {exc}). Launch again to continue where "
            f"it stopped, or fetch it with `{fetch_command(plan.repo_id, plan.tokenizer_only)}`"
        ) from exc
    missing = missing_files(folder, plan.tokenizer_only)
    if missing:
        raise ConfigError(
            f"downloaded {plan.repo_id} to {folder}, but it lacks {missing}; it cannot be served"
        )
    print(f"model: {plan.repo_id} is in {folder}", flush=True)
    return str(folder)


def check_model(path: str, tokenizer_only: bool = False, setting: str | None = None) -> str:
    """A local folder for the model: as given, from the Hugging Face cache, or downloaded now. Never a hub id."""
    found = find_model(path, tokenizer_only, setting)
    return found if isinstance(found, str) else download_model(found)


def describe_model(path: str, tokenizer_only: bool = False) -> str:
    """One line for a dry run on where the model will come from; downloads and writes nothing."""
    if path in ("tiny", "tiny-moe"):
        return f"model: {path} (a built-in test model, built at the first launch)"
    try:
        found = find_model(path, tokenizer_only)
    except ConfigError as exc:
        return f"model: a launch would stop here: {exc}"
    if isinstance(found, ModelDownload):
        return f"model: not here; a launch first downloads {found.summary()}"
    return f"model: {found}"


def check_tinker() -> list[str]:
    """The SDK installed and a key of the right shape, as problems to report (empty when fine)."""
    from trainer.backends.tinker import check_api_key, import_tinker

    problems = []
    for check in (import_tinker, check_api_key):
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


NVIDIA_CONTROL = Path("/dev/nvidiactl")  # present wherever an NVIDIA driver is: no CUDA device without it


def probe_gpu_memory() -> tuple[int, int] | None:
    """(total, free) bytes of the smallest visible CUDA device, or None without one. Read in a short-lived
    subprocess: a CUDA context in the launcher would hold ~0.5 GiB of the GPU for the whole run."""
    if not NVIDIA_CONTROL.exists():
        return None
    code = (
        "import json, torch\n"
        "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "print(json.dumps([torch.cuda.mem_get_info(i) for i in range(n)]))"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        devices = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else []
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    if not devices:
        return None
    free, total = min(devices, key=lambda d: d[1])
    return int(total), int(free)


def fetch_model_config(repo_id: str) -> dict[str, Any] | None:
    """config.json alone from the hub (a few KB), for a plan before the weights are downloaded; None if refused
    (a gated or unknown repo, no network)."""
    try:
        from huggingface_hub import hf_hub_download

        return dict(json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text()))
    except Exception:  # the hub library raises many types (gated, missing, offline); the plan is then skipped
        return None


def check_teacher_tokenizer(student: str, teacher: str) -> list[str]:
    """A teacher scores the student's token ids, so both must read ids the same way: the same vocabulary (ids and
    the strings they stand for) and, where either has one, the same chat template (the same prompt, tokenized alike).
    The reasons a teacher model is refused, or none."""
    from transformers import AutoTokenizer

    s, t = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    problems = []
    sv, tv = s.get_vocab(), t.get_vocab()
    if sv != tv:
        differ = sorted(set(sv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:3]
        problems.append(
            f"distill.teacher={teacher!r}: its tokenizer differs from the student's ({len(tv)} tokens against "
            f"{len(sv)}; e.g. {', '.join(f'{k!r}={v}' for k, v in differ)}): the teacher scores the student's token "
            "ids, so both must share one tokenizer; choose a teacher of the student's model family"
        )
    if (s.chat_template or None) != (t.chat_template or None):
        problems.append(
            f"distill.teacher={teacher!r}: its chat template differs from the student's, so a prompt would read "
            "differently to it; choose a teacher with the student's template"
        )
    return problems


def pin_kv_cache(cfg: RunConfig, plan: MemoryPlan, gateway: dict[str, Any] | None) -> list[str]:
    """On a GPU vLLM shares with the trainer, give vLLM the plan's KV cache as --kv-cache-memory-bytes (written into
    the run's config, hence gateway.yaml): without it vLLM sizes its cache from the free memory it sees while it
    profiles, which after a healing restart includes the trainer's swinging activations (vLLM either refuses to
    start or takes the trainer's room). The first start is the same either way: the plan's cache is what vLLM's
    budget leaves. A value the user set is kept."""
    vllm = dict(cfg.inference.get("vllm") or {})
    if (
        gateway is None
        or not plan.on_cuda
        or plan.gpu_bytes is None
        or not plan.shared_replicas
        or vllm.get("kv_cache_memory_bytes") is not None
    ):
        return []
    kv = int(plan.vllm_facts["kv"])
    cfg.inference = {**cfg.inference, "vllm": {**vllm, "kv_cache_memory_bytes": kv}}
    return [
        f"  vLLM shares its GPU with the trainer: --kv-cache-memory-bytes {kv} (the plan's KV cache, "
        "inference.vllm.kv_cache_memory_bytes), so a vLLM restarted beside the trainer gets the same cache; "
        "set the key to choose another"
    ]


def plan_memory(
    cfg: RunConfig, model_path: str, gateway: dict[str, Any] | None, dry_run: bool
) -> tuple[list[str], list[str]]:
    """The memory plan's lines to print and the reasons the config cannot fit (empty when it fits, runs on CPU,
    or the GPU's size is unknown). A dry run without a GPU plans for CUDA unless model.device is cpu."""
    from trainer.orchestration.memory_plan import (
        build_memory_plan,
        check_fit,
        choose_recomputed_layers,
        format_plan,
    )
    from trainer.orchestration.model_shape import GiB, load_model_config

    if cfg.launch.backend != "local":
        return [], []
    model_config = load_model_config(model_path)
    if model_config is None and hub_reachable():
        model_config = fetch_model_config(model_path)
    if model_config is None:
        return [
            f"memory plan: no config.json for model.path={model_path!r} here (not a folder, not in the Hugging Face "
            "cache); download the model (or point model.path at its folder) to see the plan"
        ], []
    teacher_config, notes = None, []
    if cfg.distill.teacher is not None and teacher_kind(cfg.distill.teacher) == "model":
        teacher_config = load_model_config(cfg.distill.teacher)
        if teacher_config is None and hub_reachable():
            teacher_config = fetch_model_config(cfg.distill.teacher)
        if teacher_config is None:
            notes.append(
                f"memory plan: no config.json for distill.teacher={cfg.distill.teacher!r} here: the teacher's "
                "weights are not counted below"
            )
    probed = probe_gpu_memory() if cfg.model.device != "cpu" else None
    on_cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and (probed is not None or dry_run))
    stated = cfg.launch.gpu_memory_gib
    gpu_bytes = int(stated * GiB) if stated is not None else (probed[0] if probed else None)
    source = "launch.gpu_memory_gib" if stated is not None else "read from the device"
    plan = build_memory_plan(cfg, model_config, gateway, gpu_bytes, on_cuda, teacher_config)
    if cfg.model.gradient_checkpointing == "auto":
        # The choice goes into the run's config.yaml: the trainer recomputes exactly the planned layers.
        cfg.model.checkpoint_layers, why = choose_recomputed_layers(plan, cfg)
        plan = build_memory_plan(cfg, model_config, gateway, gpu_bytes, on_cuda, teacher_config)
        notes.append(why)
    lines = notes + format_plan(plan, source)
    problems = check_fit(plan, cfg, gateway)
    if not problems:
        lines += pin_kv_cache(cfg, plan, gateway)
    if probed is not None and not problems:
        need = plan.trainer.total + plan.shared_replicas * plan.vllm_facts.get("share", 0)
        if need > probed[1]:
            lines.append(
                f"  warning: only {probed[1] / GiB:.2f} GiB of the GPU is free now (other processes hold the rest); "
                f"this run needs {need / GiB:.2f} GiB"
            )
    return lines, problems


def preflight(cfg: RunConfig) -> str:
    """Everything missing, reported at once within seconds: the model (or, for Tinker, only its tokenizer), the
    Tinker key, the environment's data. Then a model that is not here is downloaded (only once nothing else
    stands in the way). Returns the local model (or tokenizer) folder, never a hub id."""
    problems: list[str] = []
    tinker = cfg.launch.backend == "tinker"
    wanted = (cfg.tinker.tokenizer or cfg.model.path) if tinker else cfg.model.path
    found: str | ModelDownload | None = None
    try:
        found = find_model(wanted, tokenizer_only=tinker)
    except ConfigError as exc:
        problems.append(str(exc))
    if tinker and not cfg.tinker.client_factory:
        problems += check_tinker()
    specs = cfg.rollout.env_specs()
    # env files' and verifiers environments' checks need the model's tokenizer folder: those run after the download
    for spec in specs:
        if not (spec.is_file or spec.is_verifiers):
            problems += check_environment(cfg, found if isinstance(found, str) else wanted, spec)
    teacher: str | ModelDownload | None = None  # a teacher model of its own (not an adapter), once found
    if cfg.distill.teacher is not None:
        try:  # the folder the trainer will load, fixed now (a teacher run's newest adapter at launch)
            cfg.distill.teacher = resolve_teacher(cfg.distill.teacher)
            if teacher_kind(cfg.distill.teacher) == "model":  # on Tinker only its tokenizer is read here
                teacher = find_model(cfg.distill.teacher, tokenizer_only=tinker, setting="distill.teacher")
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("cannot start:\n  - " + "\n  - ".join(problems))
    assert found is not None  # find_model either answered or its problem was raised above
    model_path = found if isinstance(found, str) else download_model(found)
    problems = [
        p
        for spec in specs
        if spec.is_file or spec.is_verifiers
        for p in check_environment(cfg, model_path, spec)
    ]
    if cfg.distill.by_url:  # a server elsewhere: it answers, serves one base model, tokenizes as the student
        from trainer.training.teacher_http import preflight_url_teacher  # imports torch: only when asked

        problems += preflight_url_teacher(cfg.distill, model_path)
    if teacher is not None:  # a model of its own, sharing the student's tokenizer
        folder = teacher if isinstance(teacher, str) else download_model(teacher)
        problems += check_teacher_tokenizer(model_path, folder)
        if not tinker:  # the local trainer loads it from that folder; Tinker by its name
            cfg.distill.teacher = folder
    if problems:
        raise ConfigError("cannot start:\n  - " + "\n  - ".join(problems))
    return model_path


def check_environment(cfg: RunConfig, model_path: str, spec: EnvSpec | None = None) -> list[str]:
    """Run one environment's own pre-flight (`spec`: one of cfg.rollout.env_specs(); None = the first); its notes
    are printed, its problems returned (in a mixed run, each named with its environment)."""
    spec = spec or cfg.rollout.env_specs()[0]
    who = f"{spec.name}: " if cfg.rollout.envs else ""
    try:
        argv = env_preflight_command(cfg, model_path, spec)
    except ConfigError as exc:  # an unknown environment: reported beside every other problem
        return [str(exc)]
    if argv is None:
        return []
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("note: "):
            print(f"environment: {who}{line.removeprefix('note: ')}", flush=True)
    if proc.returncode == 0:
        return []
    lines = [line for line in proc.stderr.splitlines() if line.startswith("preflight: ")]
    return [who + line.removeprefix("preflight: ") for line in lines] or [
        f"environment {spec.env!r} failed its pre-flight (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    ]
