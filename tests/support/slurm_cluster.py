"""A one-node Slurm cluster on loopback, from Debian 12's packages (slurm-wlm, slurmdbd, munge, mariadb-server),
for tests/integration/slurm/test_slurm_real.py:

    with SlurmCluster() as cluster:        # munged, MariaDB, slurmdbd, slurmctld, slurmd; node idle
        subprocess.run(["sinfo"], env=cluster.env)

Everything lives in one temporary folder: a munge key and socket, the configuration files, state, spool,
database and logs; every daemon listens on 127.0.0.1 on a free port. SLURM_CONF in `cluster.env` points
Slurm's commands (sbatch, squeue, scancel, sacct, and submitit through them) at this cluster, so the
machine's /etc/slurm, /etc/munge and its own daemons, if any, are never read or touched. Accounting
(slurmdbd on MariaDB) is there because submitit asks `sacct` for the state of a job that left no result:
without it a cancelled job would be waited for forever.

stop() cancels what is still queued, then ends the daemons it started and the processes of their jobs
(those whose environment holds this cluster's SLURM_CONF), by pid, and removes the folder.
Run as root (SlurmUser=root: slurmd starts jobs as the submitting user).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

# the programs of the Debian packages; .ci/run installs them
DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "squeue", "scancel", "sacct", "sinfo")
PACKAGES = "slurm-wlm slurmdbd munge mariadb-server"
NODE = "localhost"
PARTITION = "debug"


def missing() -> list[str]:
    """The programs this cluster needs that are not installed (Debian puts the daemons in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [p for p in (*DAEMONS, *COMMANDS) if shutil.which(p, path=path) is None]


def _program(name: str) -> str:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which(name, path=path)
    if found is None:
        raise RuntimeError(f"{name} is not installed (apt-get install {PACKAGES})")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path.name}: no log)"


class SlurmCluster:
    """munged, MariaDB, slurmdbd, slurmctld and slurmd in `folder` (a new temporary one by default)."""

    def __init__(self, folder: Optional[Path] = None, name: str = "kvexptest", kill_wait_s: int = 5):
        self.folder = Path(folder or tempfile.mkdtemp(prefix="kvexp-slurm-")).resolve()
        self.own_folder = folder is None
        self.name = name
        self.kill_wait_s = kill_wait_s
        self.ports = {k: _free_port() for k in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
        self.conf = self.folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env.pop("SLURM_JOB_ID", None)  # a test run inside a Slurm job still submits to this cluster
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------ start
    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 90) -> "SlurmCluster":
        d = self.folder
        os.chmod(d, 0o755)  # munged: every folder on its socket's path must be searchable by all
        for sub in ("state", f"spool/{NODE}", "db", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (d / "plugstack.conf").write_text("")  # not /etc/slurm/plugstack.conf
        self._write_configs()
        deadline = time.monotonic() + timeout_s

        self._spawn("munged", [_program("munged"), "-F", f"--key-file={key}", f"--socket={d / 'munge.sock'}",
                               f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'log/munged.log'}",
                               f"--seed-file={d / 'munged.seed'}"])
        self._wait(lambda: (d / "munge.sock").exists(), deadline, "munged", d / "log/munged.log")

        init = subprocess.run([_program("mariadb-install-db"), "--no-defaults", f"--datadir={d / 'db'}", "--user=root",
                               "--auth-root-authentication-method=normal", "--skip-test-db"],
                              capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
        if init.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed ({init.returncode}): {init.stderr[-2000:]}")
        # only this cluster's slurmdbd connects, over loopback: no users or passwords to set up
        self._spawn("mariadbd", [_program("mariadbd"), "--no-defaults", f"--datadir={d / 'db'}", "--user=root",
                                 f"--socket={d / 'mysql.sock'}", f"--port={self.ports['mariadb']}",
                                 "--bind-address=127.0.0.1", f"--pid-file={d / 'mariadb.pid'}",
                                 f"--log-error={d / 'log/mariadb.log'}", "--skip-grant-tables", "--skip-log-bin",
                                 "--innodb-buffer-pool-size=64M"])
        self._wait(lambda: _listening(self.ports["mariadb"]), deadline, "mariadbd", d / "log/mariadb.log")

        self._spawn("slurmdbd", [_program("slurmdbd"), "-D"])
        self._wait(lambda: _listening(self.ports["slurmdbd"]), deadline, "slurmdbd", d / "log/slurmdbd.log")
        self._spawn("slurmctld", [_program("slurmctld"), "-D", "-i"])  # -i: no state from an earlier run
        self._wait(lambda: _listening(self.ports["slurmctld"]), deadline, "slurmctld", d / "log/slurmctld.log")
        self._spawn("slurmd", [_program("slurmd"), "-D", "-N", NODE])
        self._wait(self._node_idle, deadline, "slurmd", d / "log/slurmd.log")
        self._wait(lambda: self.run("sacct", "-n", "-X").returncode == 0, deadline, "slurmdbd",
                   d / "log/slurmdbd.log")
        return self

    def _write_configs(self) -> None:
        d, p = self.folder, self.ports
        mem_mb = max(1024, min(4096, psutil.virtual_memory().total // 2**20 // 2))
        common = ["AuthType=auth/munge", f"AuthInfo=socket={d / 'munge.sock'}", "SlurmUser=root"]
        self.conf.write_text("\n".join([
            f"ClusterName={self.name}",
            f"SlurmctldHost={NODE}(127.0.0.1)",
            f"SlurmctldPort={p['slurmctld']}",
            f"SlurmdPort={p['slurmd']}",
            *common,
            "SlurmdUser=root",
            "CredType=cred/munge",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool/%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log/slurmctld.log'}",
            f"SlurmdLogFile={d / 'log/slurmd.log'}",
            f"PlugStackConfig={d / 'plugstack.conf'}",
            "MailProg=/bin/true",
            "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc",  # cgroups may be out of reach in a container
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=localhost",
            f"AccountingStoragePort={p['slurmdbd']}",
            f"AccountingStoragePass={d / 'munge.sock'}",  # the munge socket of the connection to slurmdbd
            "ReturnToService=2",
            f"KillWait={self.kill_wait_s}",  # SIGTERM -> SIGKILL when a job is cancelled
            "InactiveLimit=0",
            "MinJobAge=300",
            f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory={mem_mb} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        dbd = d / "slurmdbd.conf"  # found next to SLURM_CONF; slurmdbd wants it private
        dbd.write_text("\n".join([
            *common,
            f"DbdHost={NODE}",
            "DbdAddr=127.0.0.1",
            f"DbdPort={p['slurmdbd']}",
            f"PidFile={d / 'slurmdbd.pid'}",
            f"LogFile={d / 'log/slurmdbd.log'}",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={p['mariadb']}",
            "StorageUser=root",
            "StorageLoc=slurm_acct_db",
        ]) + "\n")
        dbd.chmod(0o600)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.folder / "log" / f"{name}.out", "ab")
        try:
            self.procs[name] = subprocess.Popen(argv, env=self.env, cwd=self.folder, stdin=subprocess.DEVNULL,
                                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()

    def _wait(self, ready, deadline: float, name: str, log: Path) -> None:
        while not ready():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                out = _tail(self.folder / "log" / f"{name}.out")
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{out}\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready in time:\n{_tail(log)}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        p = self.run("sinfo", "-h", "-n", NODE, "-o", "%T")
        return p.returncode == 0 and p.stdout.strip() == "idle"

    # ------------------------------------------------------------ use
    def run(self, *argv: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command on this cluster."""
        return subprocess.run([_program(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True,
                              timeout=timeout_s)

    def jobs(self) -> dict[str, str]:
        """squeue's jobs of this cluster: id (`<array job>_<task>` for an array's task) -> state."""
        p = self.run("squeue", "-h", "-r", "-o", "%i %T")
        return dict(line.split(maxsplit=1) for line in p.stdout.splitlines() if line.strip())

    def accounting(self, job: str) -> set[tuple[str, str, str]]:
        """sacct's (JobID, JobIDRaw, State) of each allocation of `job` (steps left out): JobID is
        `<array job>_<task>` for an array's task, JobIDRaw its own job id (its SLURM_JOB_ID); asking for an
        array's job id answers every task of the array."""
        p = self.run("sacct", "-n", "-X", "-P", "-o", "JobID,JobIDRaw,State", "-j", job)
        return {tuple(line.split("|", 2)) for line in p.stdout.splitlines() if line.count("|") == 2}

    def job_processes(self, job_id: Optional[str] = None) -> list[psutil.Process]:
        """Live processes started for this cluster's jobs (slurmstepd and what it runs, kvexp's servers
        included): their environment holds this cluster's SLURM_CONF; the daemons are left out. With
        job_id, only the processes of that job (SLURM_JOB_ID)."""
        daemons = {p.pid for p in self.procs.values()}
        out = []
        for proc in psutil.process_iter():
            if proc.pid in daemons or proc.pid == os.getpid():
                continue
            try:
                env = proc.environ()
                if (env.get("SLURM_CONF") == str(self.conf) and job_id in (None, env.get("SLURM_JOB_ID"))
                        and proc.status() != psutil.STATUS_ZOMBIE):
                    out.append(proc)
            except (psutil.Error, OSError):
                continue
        return out

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """Cancel this cluster's jobs, end its daemons (slurmd first, munged last) and what they started."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--full", "-u", "root", timeout_s=10)
                end = time.monotonic() + self.kill_wait_s + 10
                while self.jobs() and time.monotonic() < end:
                    time.sleep(0.5)
            except (subprocess.SubprocessError, OSError):
                pass
        left = self.job_processes()
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            left += [c for c in _children(proc.pid) if c not in left]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for p in left:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=5)
        if self.own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


if __name__ == "__main__":  # a cluster by hand: python tests/support/slurm_cluster.py, then Ctrl-C
    with SlurmCluster() as c:
        print(f"export SLURM_CONF={c.conf}")
        print(c.run("sinfo").stdout, end="", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
