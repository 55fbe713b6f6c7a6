"""Three optimizer steps of the tiny model on the fixture batch, as one rank of a torchrun job; rank 0 writes the
resulting LoRA weights and per-step results. tests/integration/test_distributed.py runs it with 1 and with 2 ranks
on CPU (gloo); tests/gpu/gpu_helpers.py runs the same steps on CUDA over NCCL.

    python -m torch.distributed.run --standalone --nproc_per_node N tests/dist_step.py OUT_DIR MICRO_BATCH_TOKENS
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.backends.collectives import RankInfo, rank_info  # noqa: E402
from trainer.backends.data_parallel import RankZeroBackend, follow  # noqa: E402
from trainer.backends.local import LocalBackend  # noqa: E402
from trainer.training.backend import TrainingBackend  # noqa: E402
from trainer.training.batch import IntakeOptions, convert_batch  # noqa: E402
from trainer.training.config import RunConfig  # noqa: E402
from trainer.training.loss_params import LossParams  # noqa: E402
from trainer.training.schedule import adam_params  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "runapi_batch.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@dataclass
class RankZeroRun:
    """What rank 0 has after the three steps."""

    info: RankInfo
    local: LocalBackend
    backend: TrainingBackend
    steps: list[dict[str, Any]]

    def save_lora(self, path: Path) -> None:
        weights = {
            n: p.detach().cpu().contiguous()
            for n, p in self.local.model.named_parameters()
            if p.requires_grad
        }
        save_file(weights, str(path))

    def close(self) -> None:
        if isinstance(self.backend, RankZeroBackend):
            self.backend.close()


def three_steps(
    out: Path,
    micro_batch_tokens: int,
    model: dict[str, Any],
    process_group: str,
    prepare: Callable[[], None] | None = None,
) -> RankZeroRun | None:
    """The tiny model (`model`: the config's model section) trained on the fixture batch whole, reversed (other
    shards) and as one example (fewer than the ranks); None on a rank other than 0, which follows rank 0's steps.
    `prepare` runs once the backend is built (before any step)."""
    info = rank_info()
    cfg = RunConfig.model_validate(
        {
            "model": {"path": "tiny", **model},
            "lora": {"rank": 8, "alpha": 32, "target_modules": TARGETS},
            "trainer": {
                "output_dir": str(out / f"rank{info.rank}"),
                "max_seq_len": 64,
                "micro_batch_tokens": micro_batch_tokens,
                "logprob_chunk_tokens": 16,
            },
            "distributed": {"backend": process_group},
        }
    )
    local = LocalBackend(cfg)
    if prepare is not None:
        prepare()
    if not info.is_main:
        follow(local)
        return None
    backend: TrainingBackend = RankZeroBackend(local) if info.world_size > 1 else local
    examples = convert_batch(
        json.loads(FIXTURE.read_text())["batch"], IntakeOptions(vocab_size=2048, max_seq_len=64)
    ).examples
    steps = []
    for batch in (examples, examples[::-1], examples[:1]):
        fb, optim = backend.train_step(
            batch,
            LossParams("importance_sampling"),
            "seq_mean_token_sum",
            adam_params(1e-2, grad_clip_norm=1.0),
        )
        steps.append(
            {
                "loss": fb.loss,
                "grad_norm": optim["optim/grad_norm"],
                "metrics": fb.metrics,
                "trainer_logprobs": fb.trainer_logprobs,
            }
        )
    return RankZeroRun(info, local, backend, steps)


def main(out: Path, micro_batch_tokens: int) -> None:
    torch.set_num_threads(1)
    run = three_steps(out, micro_batch_tokens, {}, "gloo")
    if run is None:
        return
    run.save_lora(out / "lora.safetensors")
    (out / "results.json").write_text(json.dumps(run.steps))
    run.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
