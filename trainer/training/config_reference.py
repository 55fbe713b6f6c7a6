"""`python -m trainer config-reference`: docs/configuration.md, generated. The prose around the tables lives here;
every table comes from the models (rlcommon/config_rows.py): the run config's sections from RunConfig, the
`inference:` section from the gateway's own model, asked of `python -m inference.config --reference` (each process
imports only its own package), with the keys that attach a run to a shared engine (EngineAttachKeys) added."""

from __future__ import annotations

import json
import subprocess
import sys

from rlcommon.config_rows import Row, Table, tables
from trainer.training.config import EngineAttachKeys, RunConfig

INTRO = """# Configuration reference

For whoever writes a recipe. A run is configured by one YAML file (`configs/*.yaml`; `--config FILE`) with dotted
`key=value` overrides on the command line (`bash launch.sh toy optim.lr=2e-5 rollout.num_steps=50`). Values are read
as YAML (numbers, booleans, `null`, lists like `[a, b]`); anything else stays a string. Every section refuses unknown
keys, and an error names the dotted key, the value seen (never a token) and the limit.

```bash
.venv/bin/python -m trainer config --config configs/gsm8k.yaml optim.lr=2e-5   # print the resolved run config
.venv/bin/python -m inference.config RUN_DIR/gateway.yaml                       # validate a gateway config
```

`python -m inference.config` also takes a whole run config (`configs/*.yaml`): it then validates that config's
`inference:` section, with the model and the versions kept filled in from `model.path` and `rollout.max_staleness` as
the launcher would.

The `inference:` section is the gateway's own: the run config keeps it as a free mapping, and launch.sh completes it
(model folder, sampler, ports, a publish token where needed), validates it with the gateway's model and writes it to
`RUN_DIR/gateway.yaml` (mode 0600). Two rules join the sections:

- `inference.keep_versions` (policy versions behind the current one that stay loaded in vLLM) follows
  `rollout.max_staleness` unless set, so every version the trainer may still accept stays loaded; set below it, the
  run config is refused. vLLM gets `inference.keep_versions` + 3 LoRA slots (the kept versions, the current one, the
  one being published before the oldest is unloaded, and the base model's zero adapter), plus
  `inference.named_slots`. `launch.sh service`, which has no rollout window, keeps 2.
  The gateway's old name for it, `max_staleness`, is refused with an error naming the new one.
- `inference.sampler` and `inference.tinker` are set by the launcher from `launch.backend` and the `tinker:` section;
  a config that sets them is refused.

Other checks across sections: `loss.tis_cap` applies only to ratio losses (not `cross_entropy`, `dro` or `gspo`);
`loss.ratio_mask` to the losses that weigh tokens by the ratio (not `cross_entropy` or `dro`);
`distributed.nproc_per_node` x `distributed.nnodes` above 1 needs `launch.backend` local; `trainer.micro_batch_tokens`
must be at least `trainer.max_seq_len`; `inference.vllm.dtype=float32` is refused on CUDA; a gateway bound off
loopback needs `inference.publish_token` of 16 or more characters.

The tables below are generated from the pydantic models (`trainer/training/config.py` for the run config, with its
rollout section in `rollout_config.py` and the launcher's, Tinker's, the service's and pricing in `launch_config.py`;
`inference/config.py` for the gateway's section) by `python -m trainer config-reference`; the meaning column is each
field's own description. `tests/unit/test_docs.py` fails when this page differs from the command's output: edit a
description in the model, then run `.venv/bin/python -m trainer config-reference > docs/configuration.md`.
"""

# Prose under a section's heading, above its table.
NOTES = {
    "inference.tinker": """Set by the launcher when the run samples through Tinker (launch.backend=tinker).""",
    "distill": """On-policy distillation from a teacher adapter, model or server (docs/training.md#on-policy-distillation).""",
    "eval": """Held-out evaluation while training (docs/training.md#held-out-evaluation); `python -m trainer eval` reads the same keys.""",
    "distributed": """Data-parallel training: torchrun starts the ranks, DDP sums LoRA gradients across them. The frozen base is replicated
on every rank (LoRA's optimizer state is tiny, so sharding it with FSDP would buy nothing).""",
    "publish": """How each new adapter reaches the sampler: the on-policy gate around it, its overlap with the next batch's wait, and
the check that the served adapter is the trained one.""",
    "pricing": """Prices the comparison report uses to estimate cost; edit them to your contract.""",
    "service": """The local Tinker-protocol service (`bash launch.sh service`): the unmodified tinker SDK trains LoRA adapters of
`model.path` here, several clients on one base.""",
}

HEADER = "| key | type | default | meaning |\n| --- | --- | --- | --- |"


def gateway_tables() -> list[Table]:
    """The `inference:` section's tables, from the gateway's model in its own interpreter."""
    out = subprocess.run(
        [sys.executable, "-m", "inference.config", "--reference"], capture_output=True, text=True, check=True
    ).stdout
    return [Table(t["key"], [Row(**r) for r in t["rows"]]) for t in json.loads(out)]


def run_tables() -> list[Table]:
    """Every section's table in the run config's order, the gateway's in place of the free `inference` mapping."""
    found: list[Table] = []
    for name in RunConfig.model_fields:
        if name != "inference":
            found += tables(RunConfig.model_fields[name].annotation, f"{name}.")  # type: ignore[arg-type]
            continue
        gateway = gateway_tables()
        engine = tables(EngineAttachKeys, "inference.")[0].rows
        gateway[0] = Table("inference", [*gateway[0].rows, *(_run_side(r) for r in engine)])
        found += gateway
    return found


def _run_side(row: Row) -> Row:
    return Row(row.key, row.type, row.default, f"the run's, not the gateway's: {row.meaning}")


def render(found: list[Table]) -> str:
    parts = [INTRO, "## Sections\n"]
    for table in found:
        level = "###" if "." not in table.key else "####"
        parts.append(f"{level} `{table.key}`\n")
        if table.key in NOTES:
            parts.append(NOTES[table.key] + "\n")
        rows = [HEADER, *(_escaped(r).markdown() for r in table.rows)]
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def _escaped(row: Row) -> Row:
    """A meaning with a literal | (|value|) would end its cell."""
    meaning = row.meaning.replace("\\|", "|").replace("|", "\\|")
    return Row(row.key, row.type, row.default, meaning)


def main(argv: list[str] | None = None) -> int:
    if argv:
        print("usage: python -m trainer config-reference > docs/configuration.md", file=sys.stderr)
        return 2
    sys.stdout.write(render(run_tables()))
    return 0
