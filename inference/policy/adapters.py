"""Adapter checks before vLLM ever sees a folder: vLLM accepts adapters that poison serving (NaN or huge weights)
and answers others with opaque 500s, so every published folder is checked here against the served base model.

Checked, each failure naming the file or tensor and what was expected:
- the path (length, existence), adapter_config.json (a JSON object with an integer `r` within the gateway's rank
  ceiling, a finite positive `lora_alpha`, string target modules);
- adapter_model.safetensors (readable, not a pickle .bin), every tensor name (a LoRA A/B of a linear module the
  base has), dtype (fp32/fp16/bf16), shape (A: r x in, B: out x r), and values (finite, |x| <= a bound).
Reading the base's shapes needs only the safetensors headers of the model folder. Names, dtypes and shapes come from
the adapter's header; its data is read once and each tensor's values checked in one vectorised pass (a Llama-8B
rank-32 adapter, 168 MB: the time to read it, ~0.1 s from the page cache). The gateway runs validate_adapter in a
worker thread, off its event loop; the interpreter lock is released while the data is read and scanned.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from inference.errors import BackendError

log = logging.getLogger("inference.adapters")
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."
LORA_PARTS = (".lora_A.weight", ".lora_B.weight")
TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors names
DTYPES = set(TORCH_DTYPES)
MAX_PATH_CHARS = 4096
MAX_CONFIG_BYTES = 1 << 20


def base_linear_shapes(model_path: str) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every 2-D weight of the base model, by module name, from the safetensors
    headers alone. A tied lm_head (no weight of its own) takes the embedding's shape."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, int]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                if name.endswith(".weight") and len(shape) == 2:
                    shapes[name.removesuffix(".weight")] = (int(shape[0]), int(shape[1]))
    if "lm_head" not in shapes:
        embedding = next((name for name in shapes if name.endswith("embed_tokens")), None)
        if embedding is not None:
            shapes["lm_head"] = shapes[embedding]
    return shapes


def check_path(path: str) -> Path:
    if len(path) > MAX_PATH_CHARS or any(len(part) > 255 for part in path.split(os.sep)):
        raise BackendError(
            400, f"adapter_path is {len(path)} characters with a component over 255: not a path"
        )
    folder = Path(path)
    try:
        if not folder.is_dir():
            raise BackendError(400, f"adapter_path {path[:200]!r} is not a folder on the gateway's machine")
    except OSError as exc:
        raise BackendError(400, f"adapter_path {path[:200]!r} cannot be read: {exc.strerror}") from exc
    return folder


def read_config(folder: Path, max_rank: int) -> dict[str, Any]:
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise BackendError(400, f"{folder} has no {CONFIG_FILE}: is it a PEFT adapter folder?")
    if cfg_file.stat().st_size > MAX_CONFIG_BYTES:
        raise BackendError(400, f"{cfg_file} is over {MAX_CONFIG_BYTES} bytes: not an adapter config")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BackendError(400, f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise BackendError(400, f"{cfg_file} must hold a JSON object, got {type(cfg).__name__}")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BackendError(400, f"{cfg_file}: 'r' must be a positive integer, got {rank!r:.40}")
    if rank > max_rank:
        raise BackendError(
            400,
            f"adapter rank {rank} exceeds the gateway's vllm.max_lora_rank {max_rank}; restart the gateway "
            "with a larger ceiling or train a smaller rank",
        )
    alpha = cfg.get("lora_alpha", rank)
    if (
        not isinstance(alpha, int | float)
        or isinstance(alpha, bool)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise BackendError(
            400, f"{cfg_file}: 'lora_alpha' must be a finite positive number, got {alpha!r:.40}"
        )
    targets = cfg.get("target_modules")
    if targets is not None and not (
        isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    ):
        raise BackendError(400, f"{cfg_file}: 'target_modules' must be a string or a list of strings")
    base = cfg.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise BackendError(400, f"{cfg_file}: 'base_model_name_or_path' must be a string")
    return cfg


def check_tensors(folder: Path, rank: int, base: dict[str, tuple[int, int]], max_abs: float) -> None:
    """Names, dtypes and shapes of every tensor against the base and the rank (from the header), then their
    values (one read of the data)."""
    from safetensors import SafetensorError, safe_open

    weights = folder / ADAPTER_FILE
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise BackendError(
                400, f"{folder} holds a pickle adapter_model.bin; save the adapter with safetensors"
            )
        raise BackendError(400, f"{folder} has no {ADAPTER_FILE}")
    try:
        with safe_open(str(weights), framework="pt") as handle:  # checks the file's layout
            names = list(handle.keys())
            if not names:
                raise BackendError(422, f"{weights} holds no tensors")
            data_start, layout = read_header(weights)
            modules: dict[str, set[str]] = {}
            for name in names:
                module, part = split_name(name, weights)
                expected = expected_shape(module, part, rank, base, name)
                modules.setdefault(module, set()).add(part)
                if layout[name]["dtype"] not in DTYPES:
                    check_dtype(handle.get_tensor(name), name)  # names the dtype as torch does
                check_shape(tuple(layout[name]["shape"]), name, expected)
            halves = [m for m, parts in modules.items() if len(parts) != 2]
            if halves:
                raise BackendError(
                    422, f"{weights}: modules with only one of lora_A/lora_B: {sorted(halves)[:5]}"
                )
        check_all_values(read_data(weights, data_start, layout, names), layout, names, max_abs)
    except SafetensorError as exc:
        raise BackendError(400, f"{weights} is not a readable safetensors file: {exc}") from exc
    except (OSError, ValueError) as exc:  # truncated or malformed headers surface as these too
        raise BackendError(400, f"{weights} cannot be read: {exc}") from exc


def read_header(weights: Path) -> tuple[int, dict[str, Any]]:
    """Where the data starts in a file safetensors has opened, and its JSON header (name -> dtype, shape,
    data_offsets from that start)."""
    with weights.open("rb") as file:
        header_len = int.from_bytes(file.read(8), "little")
        return 8 + header_len, json.loads(file.read(header_len))


def read_data(weights: Path, start: int, layout: dict[str, Any], names: list[str]) -> Any:
    """The tensors' data, read once into one uint8 tensor with plain file reads, not through a memory map: a page
    fault taken while the safetensors binding holds the interpreter lock would stall the gateway's event loop for
    as long as the disk takes; a read releases the lock while it waits."""
    import torch

    size = max(int(layout[name]["data_offsets"][1]) for name in names)
    data = torch.empty(size, dtype=torch.uint8)  # not zero-filled: a bytearray's memset would hold the lock
    array: Any = data.numpy()  # numpy's stubs do not declare the buffer protocol it has
    view, got = memoryview(array), 0
    with weights.open("rb", buffering=0) as file:
        file.seek(start)
        while got < size:  # one read call in practice
            count = file.readinto(view[got:])
            if not count:
                raise ValueError(f"the data ends after {got} of {size} bytes")
            got += count
    return data


def check_all_values(data: Any, layout: dict[str, Any], names: list[str], max_abs: float) -> None:
    """Every tensor's values: one pass over all the data when it is one dtype (as PEFT writes it; safetensors
    leaves no gaps), then tensor by tensor only to name the one at fault, or when dtypes are mixed."""
    import torch

    dtypes = {layout[name]["dtype"] for name in names}
    if len(dtypes) == 1:
        dtype = getattr(torch, TORCH_DTYPES[dtypes.pop()])
        if data.numel() % dtype.itemsize == 0:
            largest = peak(data.view(dtype))
            if math.isfinite(largest) and largest <= max_abs:
                return
    for name in names:
        dtype = getattr(torch, TORCH_DTYPES[layout[name]["dtype"]])
        begin, end = (int(x) for x in layout[name]["data_offsets"])
        raw = data[begin:end]
        if begin % dtype.itemsize:  # another writer's layout may leave a tensor unaligned for its dtype
            raw = raw.clone()
        check_values(raw.view(dtype), name, max_abs)


def split_name(name: str, weights: Path) -> tuple[str, str]:
    for part in LORA_PARTS:
        if name.startswith(PREFIX) and name.endswith(part):
            return name[len(PREFIX) : -len(part)], part
    raise BackendError(
        422,
        f"{weights}: tensor {name!r} is not a LoRA weight ('{PREFIX}<module>.lora_A.weight' or '.lora_B.weight')",
    )


def expected_shape(
    module: str, part: str, rank: int, base: dict[str, tuple[int, int]], name: str
) -> tuple[int, int]:
    if module not in base:
        raise BackendError(
            422, f"tensor {name!r} adapts {module!r}, which is not a linear module of the served base"
        )
    out_features, in_features = base[module]
    return (rank, in_features) if part == ".lora_A.weight" else (out_features, rank)


def check_dtype(tensor: Any, name: str) -> None:
    if str(tensor.dtype).removeprefix("torch.") not in ("float32", "float16", "bfloat16"):
        raise BackendError(
            422, f"tensor {name!r} has dtype {tensor.dtype}; expected float32, float16 or bfloat16"
        )


def check_shape(shape: tuple[int, ...], name: str, expected: tuple[int, int]) -> None:
    if shape != expected:
        raise BackendError(422, f"tensor {name!r} has shape {list(shape)}, expected {list(expected)}")


def peak(tensor: Any) -> float:
    """The largest |x| in one pass over the values in their own dtype: NaN if any is NaN (min and max propagate
    it), inf if any is infinite, 0 for no values."""
    import torch

    if not tensor.numel():
        return 0.0
    low, high = (float(v) for v in torch.aminmax(tensor))
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def check_values(tensor: Any, name: str, max_abs: float) -> None:
    largest = peak(tensor)
    if not math.isfinite(largest):
        raise BackendError(
            422, f"tensor {name!r} holds NaN or infinite values; such an adapter would poison serving"
        )
    if largest > max_abs:
        raise BackendError(
            422,
            f"tensor {name!r} holds |value| {largest:.3g} > {max_abs:g} (inference.max_adapter_weight_abs); "
            "trained LoRA weights stay far below: refusing what would overflow serving",
        )


def validate_adapter(path: str, base: dict[str, tuple[int, int]], max_rank: int, max_abs: float) -> None:
    """Refuse (BackendError 400/422, naming what is wrong) an adapter vLLM must never load."""
    folder = check_path(path)
    cfg = read_config(folder, max_rank)
    check_tensors(folder, int(cfg["r"]), base, max_abs)
