"""The gateway's adapter checks on real adapters of the tiny model: a good one passes; every broken or poisoned
variant is refused with 400/422 and a message naming the file or tensor, before vLLM could see it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.errors import BackendError
from inference.policy.adapters import ADAPTER_FILE, CONFIG_FILE, base_linear_shapes, validate_adapter


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory, tiny_model_path) -> str:
    from tests.helpers import make_cfg
    from trainer.backends.local import LocalBackend

    backend = LocalBackend(make_cfg(tmp_path_factory.mktemp("good")))
    with torch.no_grad():
        for p in backend.params:
            p.add_(0.01)  # lora_B starts at zero: give every tensor a real value
    return backend.save_for_sampler(1)


@pytest.fixture(scope="module")
def base(tiny_model_path) -> dict[str, tuple[int, int]]:
    return base_linear_shapes(str(tiny_model_path))


def variant(good: str, tmp_path: Path, change: Callable[[Path], None]) -> str:
    folder = tmp_path / "adapter"
    shutil.copytree(good, folder)
    change(folder)
    return str(folder)


def edit_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        tensors = load_file(str(folder / ADAPTER_FILE))
        edit(tensors)
        save_file(tensors, str(folder / ADAPTER_FILE))

    return change


def edit_config(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
        result = edit(cfg)
        (folder / CONFIG_FILE).write_text(json.dumps(cfg if result is None else result))

    return change


def first(tensors: dict[str, torch.Tensor], part: str = "lora_B") -> str:
    return next(k for k in sorted(tensors) if part in k)


def set_value(value: float) -> Callable[[Path], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[first(t)][0, 0] = value

    return edit_tensors(edit)


def widen(t: dict[str, torch.Tensor]) -> None:  # rank-16 tensors under r=8
    name = first(t, "lora_A")
    t[name] = torch.zeros(16, t[name].shape[1])


def other_hidden(t: dict[str, torch.Tensor]) -> None:  # trained for a base of another hidden size
    name = first(t, "lora_A")
    t[name] = torch.zeros(t[name].shape[0], 256)


def unknown_module(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.model.layers.9.mlp.nope_proj.lora_A.weight"] = torch.zeros(8, 128)


def not_lora(t: dict[str, torch.Tensor]) -> None:
    t["something.else"] = torch.zeros(2, 2)


def one_half(t: dict[str, torch.Tensor]) -> None:
    del t[first(t, "lora_B")]


def as_int(t: dict[str, torch.Tensor]) -> None:
    name = first(t)
    t[name] = t[name].to(torch.int32)


def truncate(folder: Path) -> None:
    data = (folder / ADAPTER_FILE).read_bytes()
    (folder / ADAPTER_FILE).write_bytes(data[: len(data) // 2])


def to_pickle(folder: Path) -> None:
    (folder / ADAPTER_FILE).rename(folder / "adapter_model.bin")


CASES = {
    "nan": (set_value(float("nan")), 422, "NaN or infinite"),
    "inf": (set_value(float("inf")), 422, "NaN or infinite"),
    "huge 1e30": (set_value(1e30), 422, "max_adapter_weight_abs"),
    "rank 16 under r=8": (edit_tensors(widen), 422, "expected [8, 128]"),
    "other hidden size": (edit_tensors(other_hidden), 422, "has shape [8, 256]"),
    "module the base lacks": (edit_tensors(unknown_module), 422, "not a linear module of the served base"),
    "not a LoRA tensor": (edit_tensors(not_lora), 422, "'something.else' is not a LoRA weight"),
    "lora_A without lora_B": (edit_tensors(one_half), 422, "only one of lora_A/lora_B"),
    "integer dtype": (edit_tensors(as_int), 422, "dtype torch.int32"),
    "truncated safetensors": (truncate, 400, "adapter_model.safetensors"),
    "empty safetensors": (lambda f: (f / ADAPTER_FILE).write_bytes(b""), 400, "adapter_model.safetensors"),
    "corrupt safetensors": (lambda f: (f / ADAPTER_FILE).write_bytes(b"\xff" * 64), 400, "safetensors"),
    "pickle .bin": (to_pickle, 400, "pickle adapter_model.bin"),
    "config is a list": (edit_config(lambda c: [c]), 400, "must hold a JSON object, got list"),
    "config without r": (edit_config(lambda c: c.pop("r") and None), 400, "'r' must be a positive integer"),
    "r is 1e400": (
        lambda f: (f / CONFIG_FILE).write_text('{"r": 1e400}'),
        400,
        "'r' must be a positive integer",
    ),
    "r above the ceiling": (
        edit_config(lambda c: c.update(r=16)),
        400,
        "exceeds the gateway's vllm.max_lora_rank",
    ),
    "alpha NaN": (lambda f: (f / CONFIG_FILE).write_text('{"r": 8, "lora_alpha": NaN}'), 400, "lora_alpha"),
    "config not JSON": (lambda f: (f / CONFIG_FILE).write_text("{oops"), 400, "not valid JSON"),
    "no config": (lambda f: (f / CONFIG_FILE).unlink(), 400, "no adapter_config.json"),
}


def test_a_trained_adapter_passes(good_adapter, base):
    validate_adapter(good_adapter, base, max_rank=8, max_abs=1e4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_adapter_is_refused_naming_what_is_wrong(case, good_adapter, base, tmp_path):
    change, status, needle = CASES[case]
    path = variant(good_adapter, tmp_path, change)
    with pytest.raises(BackendError) as err:
        validate_adapter(path, base, max_rank=8, max_abs=1e4)
    assert err.value.status == status and needle in err.value.message, err.value.message


@pytest.mark.parametrize(
    "path,needle",
    [("/no/such/folder", "is not a folder"), ("/x" * 200, "is not a folder"), ("/" + "a" * 300, "over 255")],
)
def test_paths_that_are_not_adapter_folders(path, needle, base):
    with pytest.raises(BackendError) as err:
        validate_adapter(path, base, max_rank=8, max_abs=1e4)
    assert err.value.status == 400 and needle in err.value.message


def test_base_shapes_cover_every_projection_and_the_tied_lm_head(base):
    assert base["model.layers.0.self_attn.q_proj"] == (128, 128)
    assert base["lm_head"] == (2048, 128)
