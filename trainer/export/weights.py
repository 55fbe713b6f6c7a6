"""The exported weights: the adapter as a standard PEFT folder, or the base with the adapter merged in (PEFT's
merge_and_unload) saved as a Hugging Face model folder with the base's tokenizer, chat template and generation
config. Both are written into a temporary sibling of the destination and renamed into place when complete: an
interrupted export leaves no folder that looks finished."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.export.origin import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ExportError, ExportSource

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHARD_SIZE = "4GB"
# Files of a model folder besides its weights that a merged folder carries over as they are.
CARRIED = ("generation_config.json",)


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out`, renamed to `out` when the block ends without an exception (removed if not)."""
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_adapter(src: ExportSource, out: Path) -> None:
    """The adapter's weights as they are, and its config naming the base by hub id (and revision) where known."""
    config = json.loads((src.adapter / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = src.base.name
    if src.base.revision:
        config["revision"] = src.base.revision
    shutil.copyfile(src.adapter / ADAPTER_WEIGHTS, out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def base_dtype(folder: Path) -> str:
    """The dtype the base's config.json declares (float32 when it declares none)."""
    config = json.loads((folder / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(declared).removeprefix("torch.")


def merged_bytes(folder: Path, dtype: str) -> int:
    """About how many bytes the merged weights take in `dtype`: the base's safetensors, rescaled from its dtype."""
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    scale = DTYPE_BYTES.get(dtype, 4) / DTYPE_BYTES.get(base_dtype(folder), 4)
    return int(weights * scale)


def check_disk(out: Path, needed: int) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise ExportError(
            f"the merged model needs about {needed / 1e9:.2f} GB in {probe}, and {free / 1e9:.2f} GB is free there; "
            f"free {(needed - free) / 1e9:.2f} GB or more, or give --out on a larger disk"
        )


def write_merged(src: ExportSource, out: Path, dtype: str) -> dict[str, Any]:
    """base + adapter merged in float32 (or in `dtype` where float32 would not fit in memory), saved in `dtype` as
    sharded safetensors, with the base's tokenizer files, chat template and generation config. Returns facts for
    the card."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = src.base.folder
    fp32_bytes = merged_bytes(base, "float32")
    merge_dtype = "float32" if fp32_bytes < 0.7 * available_memory() else dtype
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=getattr(torch, merge_dtype))
    adapter_targets = json.loads((src.adapter / ADAPTER_CONFIG).read_text()).get("target_modules") or []
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in adapter_targets:
        # Merged into a tied lm_head, the delta would change the input embeddings too: give lm_head its own copy.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    merged = PeftModel.from_pretrained(model, str(src.adapter)).merge_and_unload()
    merged = merged.to(getattr(torch, dtype))
    merged.config.dtype = getattr(torch, dtype)
    merged.save_pretrained(str(out), safe_serialization=True, max_shard_size=SHARD_SIZE)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    for name in CARRIED:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    return {"merged_in": merge_dtype, "dtype": dtype}


def available_memory() -> int:
    """Bytes of memory available to a new allocation (MemAvailable), or the physical memory where unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
