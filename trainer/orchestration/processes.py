"""Child processes of the launcher: start one in its own process group with its log, wait for it with a
deadline, stop it (by its PID, or its SLURM step), and hand it a socket that is already listening so that no
port is ever chosen by one process and bound by another."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.training.polling import wait_until


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if the launcher dies, even by SIGKILL, so no component is orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket for a child to inherit (port 0 = a free one, known at once and held until the child
    owns it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    slurm_job: int | None = None  # set when argv is an srun step of this job
    pass_fds: tuple[int, ...] = ()  # inherited listening sockets
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as logf:
            logf.write(f"=== {' '.join(shlex.quote(a) for a in self.argv)}\n".encode())
            logf.flush()
            # Own process group: stopping the component also stops whatever it started.
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=die_with_parent,
                pass_fds=self.pass_fds,
            )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        """Ask the component to shut down cleanly (SIGTERM to it, not to its children)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        step = self._slurm_step()
        if step is not None:
            # A signal to srun makes SLURM SIGKILL the task, which then cannot stop what it started (the gateway
            # its vLLM); scancel delivers SIGTERM to the task itself and srun exits when the task does.
            subprocess.run(["scancel", "--signal=TERM", step], capture_output=True, timeout=30)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def _slurm_step(self) -> str | None:
        """`<job>.<step>` of this component's srun step, found by its step name."""
        if self.slurm_job is None:
            return None
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["squeue", "-h", "-s", "-j", str(self.slurm_job), "-o", "%i %j"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            for line in out.splitlines():
                step, _, name = line.strip().partition(" ")
                if name.strip() == self.name:
                    return step
        return None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def drain_backlog(fd: int) -> int:
    """Close the connections waiting on an inherited listening socket whose server died. They were made to the
    dead process (an environment's last post of scored data, say) and must not reach its successor: a run-api that
    receives data before the trainer registers never accepts the registration. Returns how many were closed."""
    sock = socket.socket(fileno=os.dup(fd))
    sock.setblocking(False)  # the flag is shared with the original: set back below
    closed = 0
    try:
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            conn.close()
            closed += 1
    finally:
        sock.setblocking(True)
        sock.close()
    return closed


def stop_child(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM one child this process started, SIGKILL if it is still there after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_first(comp: Component, timeout_s: float) -> None:
    """SIGTERM one component and give it up to `timeout_s` to exit, before the others are stopped (stop_all)."""
    if comp.proc is None or comp.proc.poll() is not None:
        return
    comp.terminate()
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: comp.exited() is not None, timeout_s, f"{comp.name} stopping", 0.1)


def stop_all(components: list[Component], timeout_s: float = 30.0) -> None:
    """SIGTERM every live component (last started first), wait up to `timeout_s` in all, then SIGKILL whatever is
    left in each component's process group."""
    live = [c for c in components if c.proc is not None and c.proc.poll() is None]
    for comp in reversed(live):
        comp.terminate()
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(c.exited() is not None for c in live), timeout_s, "components stopping", 0.1)
    for comp in live:
        if comp.slurm_job is not None and comp.proc is not None and comp.proc.poll() is None:
            # SIGTERM to srun: SLURM kills the step's tasks on every node (SIGKILL to srun alone would not).
            comp.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                comp.proc.wait(timeout=10)
    for comp in components:  # anything left in a component's group (including its children) is killed
        if comp.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(comp.proc.pid, signal.SIGKILL)
            comp.proc.wait()
