"""Is CUDA usable here, and if not, why: torch's view (is_available, the CUDA its wheel was built for) against the
driver nvidia-smi reports. `python -m trainer.backends.cuda_check` is launch.sh's check after it installs the
gpu extra (exit 1 with the reason); the trainer reuses `diagnose` instead of falling back to the CPU unannounced."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The oldest Linux driver for each CUDA toolkit's GA release (NVIDIA's CUDA Toolkit release notes, table "CUDA
# Toolkit and Corresponding Driver Versions"): what a wheel built for that CUDA needs for its full feature set.
FULL_SUPPORT_DRIVER: dict[str, str] = {
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}
# The oldest driver that runs any release of a CUDA major (minor version compatibility, same release notes). Below
# it a wheel of that major cannot start at all; between it and FULL_SUPPORT_DRIVER it usually runs.
MAJOR_FLOOR_DRIVER: dict[str, str] = {"11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}
TABLE_SOURCE = "NVIDIA's CUDA Toolkit release notes, table 'CUDA Toolkit and Corresponding Driver Versions'"
NVIDIA_SMI_TIMEOUT_S = 30.0  # nvidia-smi can take seconds to wake a GPU without persistence mode


@dataclass(frozen=True)
class CudaState:
    torch_version: str
    wheel_cuda: str | None  # torch.version.cuda: None for a CPU-only build
    available: bool  # torch.cuda.is_available()
    driver: str | None  # nvidia-smi's driver_version; None without a working nvidia-smi
    driver_error: str = ""  # why driver is None
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES as this process sees it


def parse_version(text: str) -> tuple[int, ...]:
    """'570.26' -> (570, 26). Raises ValueError on anything but dot-separated integers."""
    if not re.fullmatch(r"\d+(\.\d+)*", text.strip()):
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in text.strip().split("."))


def driver_at_least(found: str, needed: str) -> bool:
    return parse_version(found) >= parse_version(needed)


def drivers_needed(wheel_cuda: str) -> tuple[str | None, str | None]:
    """(driver for full support, oldest driver of the CUDA major) for a wheel's CUDA 'major.minor[.patch]';
    None where the table does not know it."""
    major, _, rest = wheel_cuda.partition(".")
    key = f"{major}.{rest.split('.')[0]}"
    return FULL_SUPPORT_DRIVER.get(key), MAJOR_FLOOR_DRIVER.get(major)


def query_driver(nvidia_smi: str = "nvidia-smi") -> tuple[str | None, str]:
    """(driver version, "") from nvidia-smi, or (None, why not)."""
    command = [nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except FileNotFoundError:
        return None, "nvidia-smi is not installed (no NVIDIA driver on this machine)"
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S:.0f} s"
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    first = lines[0] if lines else "(no output)"
    if proc.returncode != 0:
        return None, f"nvidia-smi failed (exit {proc.returncode}): {first}"
    try:
        parse_version(first)  # one line per GPU, all the same driver
    except ValueError:
        return None, f"nvidia-smi printed {first!r} instead of a driver version"
    return first, ""


def nvidia_device_files(dev_dir: Path = Path("/dev")) -> list[str]:
    """The GPU device files (nvidia0, nvidia1, ...) in dev_dir. nvidiactl and nvidia-uvm are left out: containers
    that mount the driver without giving a GPU have them too."""
    if not dev_dir.is_dir():
        return []
    return sorted(p.name for p in dev_dir.iterdir() if re.fullmatch(r"nvidia\d+", p.name))


def read_state() -> CudaState:
    import torch

    driver, driver_error = query_driver()
    return CudaState(
        torch_version=torch.__version__,
        wheel_cuda=torch.version.cuda,
        available=torch.cuda.is_available(),
        driver=driver,
        driver_error=driver_error,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def describe_need(wheel_cuda: str) -> str:
    """'CUDA 13.0, which needs driver >= 580.65.06' and the like, for a message."""
    full, floor = drivers_needed(wheel_cuda)
    if full is not None:
        return f"CUDA {wheel_cuda}, which needs driver >= {full}"
    if floor is not None:
        return (
            f"CUDA {wheel_cuda}, which is not in this check's table ({TABLE_SOURCE}); any CUDA "
            f"{wheel_cuda.split('.')[0]}.x needs at least driver {floor}"
        )
    return f"CUDA {wheel_cuda}, which is not in this check's table: look up the driver it needs in {TABLE_SOURCE}"


def diagnose(state: CudaState) -> str | None:
    """None when CUDA is usable, else why not: the driver found and the driver the wheel needs where known."""
    if state.available:
        return None
    torch_is = f"torch {state.torch_version}"
    if state.wheel_cuda is None:
        return (
            f"{torch_is} is a CPU-only build, so it cannot use a GPU: this environment was set up without the gpu "
            "extra; `bash launch.sh --setup` on a machine with a working nvidia-smi rebuilds it for CUDA"
        )
    need = describe_need(state.wheel_cuda)
    if state.driver is None:
        return f"no working NVIDIA driver: {state.driver_error}; {torch_is} is built for {need}"
    full, floor = drivers_needed(state.wheel_cuda)
    oldest = floor or full
    if oldest is not None and not driver_at_least(state.driver, oldest):
        return (
            f"the NVIDIA driver is too old: driver {state.driver} found, {torch_is} is built for {need}; upgrade "
            f"the driver, or install a torch built for a CUDA that driver {state.driver} supports"
        )
    if full is not None and not driver_at_least(state.driver, full):
        return (
            f"driver {state.driver} found, older than the {full} that {torch_is} (built for CUDA "
            f"{state.wheel_cuda}) needs for full support, and CUDA did not start; upgrade the driver to >= {full}"
        )
    return (
        f"driver {state.driver} found, which is enough for {torch_is} (built for {need}), yet torch sees no usable "
        f"GPU: check CUDA_VISIBLE_DEVICES (here {state.visible_devices!r}), that this user may open /dev/nvidia*, "
        "and `nvidia-smi` for a GPU in a bad state"
    )


def main() -> int:
    state = read_state()
    problem = diagnose(state)
    if problem is not None:
        print(f"cuda_check: CUDA is not usable: {problem}", file=sys.stderr)
        return 1
    import torch

    count = torch.cuda.device_count()
    print(
        f"cuda_check: CUDA works: torch {state.torch_version} (CUDA {state.wheel_cuda}), driver {state.driver}, "
        f"{count} GPU(s), the first a {torch.cuda.get_device_name(0)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
