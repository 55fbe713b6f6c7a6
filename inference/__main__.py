"""`python -m inference`: start vLLM (runtime LoRA loading on), wait for a real completion, serve the gateway.

    python -m inference --config configs/tiny_cpu.yaml inference.port=9000 [--log-dir DIR] [--port-file F]

Reads the `inference:` section of a run config (YAML + dotted overrides). Exits non-zero if vLLM cannot be
started or keeps dying; SIGTERM/SIGINT stop vLLM too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import uvicorn

from inference.app import SamplingBackend, create_app
from inference.config import GatewayConfig
from inference.policy import Policy, PolicyRegistry
from inference.replicas import ReplicaSet
from inference.vllm_backend import VLLMBackend, free_port
from trainer.config import ConfigError, RunConfig, load_config


def resolve_model(path: str) -> tuple[str, int]:
    """Local path of the base model and its vocabulary size (rows of the embedding)."""
    from transformers import AutoConfig

    if path == "tiny":
        from trainer.tiny_model import ensure_tiny_model

        path = str(ensure_tiny_model())
    cfg = AutoConfig.from_pretrained(path)
    return path, int(cfg.get_text_config().vocab_size)


def build_vllm_replicas(cfg: GatewayConfig, model_path: str, log_dir: Path,
                        registry: PolicyRegistry) -> SamplingBackend:
    def adapters() -> list[Policy]:
        return [p for p in registry.loaded() if p.adapter_path]

    n = cfg.vllm.replicas
    if n == 1:
        return VLLMBackend(cfg, model_path, log_dir / "vllm.log", restore=adapters,
                           extra_env=cfg.vllm.replica_extra_env(0))
    replicas = [
        VLLMBackend(cfg, model_path, log_dir / f"vllm-{i}.log", restore=adapters,
                    port=cfg.vllm.port + i if cfg.vllm.port else None, wait_on_crash=False,
                    extra_env=cfg.vllm.replica_extra_env(i))
        for i in range(n)
    ]
    return ReplicaSet(replicas, wanted=adapters)


async def serve(args: argparse.Namespace) -> int:
    run_cfg = load_config(RunConfig, args.config, args.overrides)
    cfg = run_cfg.inference
    assert cfg.model is not None  # RunConfig fills it from model.path
    model_path, vocab_size = (cfg.model, 0) if run_cfg.launch.backend == "tinker" else resolve_model(cfg.model)
    registry = PolicyRegistry(cfg.served_model_name, cfg.max_staleness)
    log_dir = Path(args.log_dir)
    backend: SamplingBackend
    if run_cfg.launch.backend == "tinker":
        from transformers import AutoTokenizer

        from inference.tinker_backend import TinkerSamplingBackend
        from trainer.tinker_backend import build_service_client

        tokenizer = AutoTokenizer.from_pretrained(run_cfg.tinker.tokenizer or model_path)
        vocab_size = len(tokenizer)
        backend = TinkerSamplingBackend(cfg, run_cfg.model.path, tokenizer, lambda: build_service_client(run_cfg),
                                        run_cfg.tinker.timeout_s)
    else:
        backend = build_vllm_replicas(cfg, model_path, log_dir, registry)
    app = create_app(cfg, backend, registry, vocab_size)
    port = cfg.port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=port, log_level="warning"))

    async def watch() -> None:
        while not server.should_exit:
            if backend.state == "failed":
                logging.error("the sampling backend failed; stopping the gateway (read the logs in %s)", log_dir)
                server.should_exit = True
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    if args.port_file:
        Path(args.port_file).write_text(str(port))
    logging.info("gateway on http://%s:%d, sampler %s (logs in %s)", cfg.host, port, backend.url, log_dir)
    await server.serve()
    watcher.cancel()
    return 1 if backend.state == "failed" else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run config YAML (its inference: section is used)")
    p.add_argument("--log-dir", default="logs", help="where vllm.log goes")
    p.add_argument("--port-file", help="write the gateway's port here once bound")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. inference.max_staleness=2")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return asyncio.run(serve(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
