"""A real single-node SLURM cluster (Debian's slurm-wlm 22.05 + munge) for tests, started without systemd.

Every daemon runs in the foreground as a child of the test process, so it is stopped by its own PID; nothing
is ever killed by name. Each cluster gets its own munge socket, ports, state/spool/log folders and a unique
ClusterName, so it neither touches a system munged/slurm nor clashes with a cluster of a parallel test run.

    if (reason := ensure_installed()) is not None:
        pytest.skip(reason)
    with SlurmCluster(tmp_path) as cluster:
        job_id = cluster.sbatch(["--wrap", "hostname"], cwd=tmp_path)
        assert cluster.wait_job(job_id, timeout_s=30)["JobState"] == "COMPLETED"
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from tests.helpers import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
REQUIRED_TOOLS = (
    "sbatch",
    "srun",
    "squeue",
    "scancel",
    "scontrol",
    "slurmctld",
    "slurmd",
    "munged",
    "mungekey",
)
# The daemons live in /usr/sbin, which a non-login root shell (or a venv activation) may leave off PATH.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])

TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)
# Variables that would make our clients talk to (or think they run inside) some other cluster's job.
_FOREIGN_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCONTROL_")


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def ensure_installed() -> str | None:
    """None when slurm and munge are usable (installing them with apt-get if we are root), else why not."""
    if all(_tool(t) for t in REQUIRED_TOOLS):
        return None if os.geteuid() == 0 else "a test slurm cluster needs root (slurmd runs jobs as root)"
    if os.geteuid() != 0:
        return "slurm/munge are not installed and installing them needs root"
    if shutil.which("apt-get") is None:
        return "slurm/munge are not installed and there is no apt-get to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        # A fresh image often has no package lists yet; one update is worth a retry.
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, text=True)
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr.strip()[-500:]}"
    missing = [t for t in REQUIRED_TOOLS if not _tool(t)]
    return f"installed {' '.join(PACKAGES)} but still missing {missing}" if missing else None


def _die_with_parent() -> None:
    # If the test process dies without running stop(), the daemons must not outlive it on a shared machine.
    # Runs in the child after the uid switch (the kernel clears this setting on credential changes).
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, session id) of a live process, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may hold spaces or parentheses: the fixed fields start after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[3])


def pid_alive(pid: int) -> bool:
    """Whether pid is a running process. A zombie counts as gone: it is dead and only awaits its reaper
    (here often PID 1, which may reap late)."""
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z"


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`scontrol show ... -o` prints Key=Value pairs on one line; values may themselves hold spaces."""
    keys = list(re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=", line.strip()))
    line = line.strip()
    out: dict[str, str] = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


class SlurmCluster:
    """One controller + one compute node on this machine. Use as a context manager, or start()/stop().

    conf_overrides replaces or adds global slurm.conf keys, e.g. {"GresTypes": "gpu"} to look like a GPU
    cluster whose node has no GPU, or {"KillWait": "5"} so jobs ignoring SIGTERM are killed sooner (the
    default 30 s also bounds how long stop() waits for such a job)."""

    def __init__(
        self,
        workdir: Path,
        conf_overrides: Mapping[str, str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.conf_path = self.workdir / "slurm.conf"
        # Lowercase: slurm lowercases cluster names. Unique, because jobs carry it in SLURM_CLUSTER_NAME,
        # which is how leftover job processes of *this* cluster are recognised.
        self.cluster_name = f"t{secrets.token_hex(4)}"
        self.conf_overrides = dict(conf_overrides or {})
        self.start_timeout_s = start_timeout_s
        self.node_name = ""
        self.ctld_port = 0
        self.slurmd_port = 0
        self._munge_dir: Path | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed_leftovers: list[int] = []

    # ---- environment -----------------------------------------------------------------------------------

    @property
    def munge_socket(self) -> Path:
        assert self._munge_dir is not None, "cluster not started"
        return self._munge_dir / "munge.sock"

    @property
    def env(self) -> dict[str, str]:
        """What a client needs on top of a normal environment. SLURM_CONF is enough: the munge socket is
        named in slurm.conf (AuthInfo), which every slurm client and daemon reads."""
        return {"SLURM_CONF": str(self.conf_path)}

    def client_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """A full environment for sbatch/srun/scontrol/launch scripts aimed at this cluster."""
        base = os.environ if base is None else base
        env = {k: v for k, v in base.items() if not k.startswith(_FOREIGN_ENV_PREFIXES)}
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"])
        env.update(self.env)
        return env

    def run_client(
        self, args: Sequence[str], cwd: Path | None = None, timeout_s: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            list(args), cwd=cwd, env=self.client_env(), capture_output=True, text=True, timeout=timeout_s
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    # ---- lifecycle -------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("SlurmCluster needs root")
        if self._procs:
            raise RuntimeError("SlurmCluster already started; use a new instance")
        try:
            for sub in ("state", "spool", "log"):
                (self.workdir / sub).mkdir(parents=True, exist_ok=True)
            self._start_munge()
            self._write_conf()
            env = self.client_env()
            log = self.workdir / "log"
            self._spawn(
                "slurmctld",
                [_tool_or_raise("slurmctld"), "-D", "-c", "-f", str(self.conf_path)],
                env,
                log / "slurmctld.out",
            )
            self._spawn(
                "slurmd",
                [_tool_or_raise("slurmd"), "-D", "-N", self.node_name, "-f", str(self.conf_path)],
                env,
                log / "slurmd.out",
            )
            self._wait_node_idle()
        except BaseException:
            self.stop()
            raise

    def _spawn(
        self, name: str, argv: list[str], env: Mapping[str, str], out: Path, user: str | None = None
    ) -> None:
        with out.open("ab") as f:
            # cwd=workdir: slurmstepd inherits slurmd's cwd, so nothing pins the caller's directory.
            self._procs[name] = subprocess.Popen(
                argv,
                env=dict(env),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=user,
                group=user,
                extra_groups=[] if user else None,
                # The kernel sends the death signal when the spawning *thread* exits, so only a cluster
                # started from the main thread gets it; one started from a worker thread would die with it.
                preexec_fn=_die_with_parent
                if threading.current_thread() is threading.main_thread()
                else None,
            )

    def _start_munge(self) -> None:
        # munged refuses to run as root, and as the munge user it cannot reach a root-only pytest tmp dir;
        # it also insists that its socket dir be world-executable and not group/world-writable. Hence a
        # private short dir under /tmp (short also keeps the socket path under the 108-byte limit).
        self._munge_dir = Path(tempfile.mkdtemp(prefix="slurm-munge-", dir="/tmp"))
        shutil.chown(self._munge_dir, "munge", "munge")
        self._munge_dir.chmod(0o755)
        key = self._munge_dir / "munge.key"
        # Own key: the cluster must not depend on (or read) the machine's /etc/munge/munge.key.
        subprocess.run(
            [_tool_or_raise("mungekey"), "--create", f"--keyfile={key}"],
            check=True,
            user="munge",
            group="munge",
            extra_groups=[],
            capture_output=True,
        )
        d = self._munge_dir
        argv = [
            _tool_or_raise("munged"),
            "--foreground",
            f"--socket={d / 'munge.sock'}",
            f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}",
            f"--seed-file={d / 'munged.seed'}",
            f"--log-file={d / 'munged.log'}",
        ]
        (self.workdir / "log").mkdir(parents=True, exist_ok=True)
        self._spawn(
            "munged",
            argv,
            {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            self.workdir / "log" / "munged.out",
            user="munge",
        )
        deadline = time.monotonic() + 10
        while True:
            self._check_alive()
            if self.munge_socket.exists():
                cred = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True)
                if (
                    cred.returncode == 0
                    and subprocess.run(
                        ["unmunge", "-S", str(self.munge_socket)], input=cred.stdout, capture_output=True
                    ).returncode
                    == 0
                ):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not come up:\n{self._log_tails()}")
            time.sleep(0.05)

    def _node_topology(self) -> tuple[str, str]:
        """(node name, the topology part of `slurmd -C`) with RealMemory lowered to what is free now:
        slurmd drains a node whose configured memory exceeds what it finds."""
        out = subprocess.run(
            [_tool_or_raise("slurmd"), "-C"],
            capture_output=True,
            text=True,
            check=True,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        ).stdout
        rec = parse_scontrol_record(out.splitlines()[0])
        name = rec.pop("NodeName")
        total_mib = int(rec.get("RealMemory", "1024"))
        m = re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())
        avail_mib = int(m.group(1)) // 1024 if m else total_mib
        rec["RealMemory"] = str(max(1, min(total_mib, avail_mib) * 9 // 10))
        keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
        return name, " ".join(f"{k}={rec[k]}" for k in keep if k in rec)

    def _write_conf(self) -> None:
        self.node_name, topology = self._node_topology()
        # slurmctld only acts as controller if SlurmctldHost is this machine's short hostname.
        host = socket.gethostname().split(".")[0]
        self.ctld_port = free_port()
        self.slurmd_port = free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = free_port()
        w = self.workdir
        settings: dict[str, str] = {
            "ClusterName": self.cluster_name,
            "SlurmctldHost": f"{host}(127.0.0.1)",
            "SlurmctldPort": str(self.ctld_port),
            "SlurmdPort": str(self.slurmd_port),
            "SlurmUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket}",  # both auth and job credentials use this socket
            "ProctrackType": "proctrack/linuxproc",  # no cgroups/systemd here
            "TaskPlugin": "task/none",
            "MpiDefault": "none",  # the default pmix plugin cannot load without libpmix
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "SchedulerParameters": "batch_sched_delay=0",  # else each batch job waits ~3 s to start
            "EnforcePartLimits": "ALL",  # else an unsatisfiable job pends forever instead of being rejected
            "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "JobCompType": "jobcomp/none",
            "MailProg": "/bin/true",
            "ReturnToService": "2",
            "StateSaveLocation": str(w / "state"),
            "SlurmdSpoolDir": str(w / "spool"),
            "SlurmctldPidFile": str(w / "slurmctld.pid"),
            "SlurmdPidFile": str(w / "slurmd.pid"),
            "SlurmctldLogFile": str(w / "log" / "slurmctld.log"),
            # slurmstepd keeps this file open, which is how stray step daemons of this cluster are found.
            "SlurmdLogFile": str(self.slurmd_log),
        }
        settings.update(self.conf_overrides)
        lines = [f"{k}={v}" for k, v in settings.items()]
        lines.append(f"NodeName={self.node_name} NodeAddr=127.0.0.1 {topology} State=UNKNOWN")
        lines.append(f"PartitionName=main Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP")
        self.conf_path.write_text("\n".join(lines) + "\n")

    @property
    def slurmd_log(self) -> Path:
        return self.workdir / "log" / "slurmd.log"

    def _wait_node_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        state = ""
        while time.monotonic() < deadline:
            self._check_alive()
            proc = self.run_client(["scontrol", "show", "node", self.node_name, "-o"], check=False)
            if proc.returncode == 0:
                state = parse_scontrol_record(proc.stdout).get("State", "")
                if state.split("+")[0] == "IDLE" and "DRAIN" not in state and "NOT_RESPONDING" not in state:
                    return
            time.sleep(0.1)
        raise RuntimeError(
            f"node {self.node_name} not idle after {self.start_timeout_s} s (State={state}):\n"
            f"{self._log_tails()}"
        )

    def _check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self._procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"daemon(s) exited early {dead}:\n{self._log_tails()}")

    def _log_tails(self, lines: int = 15) -> str:
        parts = []
        for f in sorted((self.workdir / "log").glob("*")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    @property
    def daemon_pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self._procs.items()}

    def running_daemons(self) -> dict[str, int]:
        return {n: p.pid for n, p in self._procs.items() if p.poll() is None}

    # ---- jobs ------------------------------------------------------------------------------------------

    def sbatch(self, args: Sequence[str], cwd: Path) -> int:
        out = self.run_client(["sbatch", "--parsable", *args], cwd=cwd).stdout.strip()
        return int(out.split(";")[0])  # --parsable prints "id" or "id;cluster"

    def job_state(self, job_id: int) -> dict[str, str]:
        """The job's `scontrol show job` record; {} once slurmctld has forgotten it (MinJobAge, 300 s)."""
        proc = self.run_client(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            if "Invalid job id" in proc.stderr:
                return {}
            raise RuntimeError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
        return parse_scontrol_record(proc.stdout.splitlines()[0])

    def wait_job(self, job_id: int, timeout_s: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            rec = self.job_state(job_id)
            if rec.get("JobState") in TERMINAL_STATES:
                return rec
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {rec.get('JobState')} after {timeout_s} s: {rec}")
            time.sleep(0.1)

    def job_ids(self) -> list[int]:
        """Jobs slurmctld still tracks as pending/running/completing."""
        out = self.run_client(["squeue", "-h", "-o", "%A"]).stdout
        return [int(x) for x in out.split()]

    # ---- teardown --------------------------------------------------------------------------------------

    def leftover_pids(self) -> list[int]:
        """Live processes this cluster's jobs left behind: its slurmstepds (they hold our slurmd log open),
        processes in a slurmstepd's session, and processes whose environment names our cluster and a job.
        The environment catches what linuxproc loses: children re-parented to init (setsid -f, double fork,
        or orphaned when the batch shell was killed). Not caught: a process that both left the session and
        overwrote its environment (setproctitle)."""
        stepds, others = self._scan()
        return sorted(stepds | others)

    def _scan(self) -> tuple[set[int], set[int]]:
        """(this cluster's live slurmstepd PIDs, other live job-side PIDs)."""
        skip = {os.getpid(), *self.daemon_pids.values()}
        log = str(self.slurmd_log)
        marker = f"SLURM_CLUSTER_NAME={self.cluster_name}".encode()
        stepds: set[int] = set()
        others: set[int] = set()
        sessions: dict[int, int] = {}
        for pid in _all_pids():
            st = _proc_stat(pid)
            if st is None or st[0] == "Z" or pid in skip:
                continue  # zombies are already dead; they await a reaper, not a signal
            sessions[pid] = st[1]
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmstepd":
                    fds = os.listdir(f"/proc/{pid}/fd")
                    if any(os.readlink(f"/proc/{pid}/fd/{fd}") == log for fd in fds):
                        stepds.add(pid)
                    continue
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue  # exited meanwhile
            if marker in environ and any(e.startswith(b"SLURM_JOB_ID=") for e in environ):
                others.add(pid)
        step_sessions = {sessions[p] for p in stepds}
        others |= {p for p, sid in sessions.items() if sid in step_sessions and p not in stepds}
        return stepds, others

    def stop(self, timeout_s: float = 60) -> list[int]:
        """Cancel every job, wait for the jobs to leave, kill what they left behind, then stop the daemons by
        PID. Returns the leftover PIDs that had to be SIGKILLed (also kept in killed_leftovers); a clean run
        returns []. Safe to call twice, and after a failed start."""
        deadline = time.monotonic() + timeout_s
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            # Before the daemons go: slurmd kills job processes only when told to, and a job left running
            # past its slurmd would be orphaned with nothing to reap it.
            with contextlib.suppress(Exception):
                ids = self.job_ids()
                if ids:
                    self.run_client(["scancel", *map(str, ids)], check=False)
                while self.job_ids() and time.monotonic() < deadline:
                    time.sleep(0.1)
        # A slurmstepd outlives squeue's view by a moment while it reports back and reaps its tasks; what
        # is left once every slurmstepd is gone escaped slurm's tracking and will not be cleaned up by it.
        settle = min(time.monotonic() + 10, deadline)
        stepds, others = self._scan()
        while stepds and time.monotonic() < settle:
            time.sleep(0.1)
            stepds, others = self._scan()
        leftovers = sorted(stepds | others)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.killed_leftovers = leftovers
        # slurmd first (it may still report to slurmctld), munged last (both use it while shutting down).
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._munge_dir is not None:
            shutil.rmtree(self._munge_dir, ignore_errors=True)
        return leftovers


def _tool_or_raise(name: str) -> str:
    path = _tool(name)
    if path is None:
        raise RuntimeError(f"{name} not found; call ensure_installed() first")
    return path
