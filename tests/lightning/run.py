"""Run ``fit_script.py`` (or another script) as 2 real ranks: forked from a pre-imported process, started as
fresh interpreters, or started by Lightning's popen launcher.

Most tests fork both ranks from a zygote (``zygote.py``), a process that has imported torch, Lightning and
lightning_dgc once: each rank then starts in milliseconds instead of paying ~5 s of imports, and gets the
variables torchrun sets, so Lightning treats the ranks as created externally, as under torchrun or srun.
``launcher="external"`` starts each rank as a fresh interpreter instead (a test that needs each rank's own
``hash()`` salt); ``launcher="popen"`` starts one process and lets Lightning's popen launcher (what
``Trainer(strategy="dgc")`` does by default) start the other: the tests that prove the default path
(``test_fit``, ``test_exit``, ``test_fabric``, an outside algorithm) use it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import free_port

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _environment() -> dict[str, str]:
    """This process's environment without the distributed variables a previous run may have left."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "MASTER_PORT",
            "MASTER_ADDR",
            "LOCAL_RANK",
            "RANK",
            "WORLD_SIZE",
            "NODE_RANK",
            "PL_TRAINER_GPUS",
        )
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _command(script: str, out: Path, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(HERE / script), "--out", str(out), *args]


LAUNCHERS = ("fork", "external", "popen")


def run_script(
    script: str, out: Path, *args: str, timeout: int = 300, check: bool = True, launcher: str = "fork"
) -> subprocess.CompletedProcess:
    """Run ``script`` on 2 ranks (1 with ``--devices 1``); rank 0's output, then rank 1's, as one process's.

    ``launcher="fork"`` forks each rank from the zygote, ``"external"`` starts each as a fresh interpreter
    (both: :func:`launch_ranks`); ``"popen"`` starts one process and lets Lightning's launcher start the
    other. The return code is the first non-zero one among the ranks.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, not {launcher!r}")
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    if launcher == "popen" or (devices == 1 and launcher == "external"):
        proc = subprocess.run(
            _command(script, out, args), env=_environment(), cwd=out.parent, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    elif devices == 1:  # one process, no distributed variables: as `python SCRIPT` would run it
        stdout, stderr = Path(f"{out}.rank0.stdout"), Path(f"{out}.rank0.stderr")
        proc = _wait(
            [Rank(_fork(script, out, args, _environment(), stdout, stderr), stdout, stderr)], timeout
        )
    else:
        proc = _wait(launch_ranks(script, out, *args, world_size=devices, launcher=launcher), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def run_nodes(script: str, out: Path, *args: str, nodes: int = 2, per_node: int = 2, timeout: int = 400,
              check: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    """Run ``script`` as ``nodes`` nodes of ``per_node`` ranks on this machine (forked from the zygote); every
    rank's output as one process's, as :func:`run_script`."""
    proc = _wait(launch_ranks(script, out, *args, world_size=nodes * per_node, per_node=per_node), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def _wait(ranks: list[Rank], timeout: float, grace: float = 20.0) -> subprocess.CompletedProcess:
    """Wait for every rank; once one has failed, give the others ``grace`` seconds, then kill them.

    Lightning's popen launcher does the same for the processes it starts: the ranks left would otherwise wait
    in a collective for the process group's timeout. A run still going after ``timeout`` is killed and raises
    :class:`subprocess.TimeoutExpired`, as :func:`subprocess.run` does.
    """
    start = time.monotonic()
    failed_at = None
    while any(r.process.poll() is None for r in ranks):
        now = time.monotonic()
        if failed_at is None and any(r.process.returncode not in (None, 0) for r in ranks):
            failed_at = now
        if now - start > timeout or (failed_at is not None and now - failed_at > grace):
            for r in ranks:
                r.stop()
            if failed_at is None:
                raise subprocess.TimeoutExpired(ranks[0].process.args, timeout, *ranks[0].output())
            break
        time.sleep(0.1)
    outputs = [r.output() for r in ranks]
    codes = [r.process.returncode for r in ranks]
    return subprocess.CompletedProcess(
        ranks[0].process.args,
        next((c for c in codes if c != 0), 0),
        "".join(out for out, _ in outputs),
        "".join(err for _, err in outputs),
    )


def run_together(
    commands: list[list[str]], envs: list[dict[str, str]], cwd: Path, timeout: float = 400
) -> list[tuple[int, str]]:
    """Start every command at once, each with its environment, and wait for all of them: each one's return code
    and output (stdout and stderr together). One still running after ``timeout`` raises
    :class:`subprocess.TimeoutExpired`, and every process left is killed."""
    processes = [
        subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for command, env in zip(commands, envs, strict=True)
    ]
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [(process.returncode, output) for process, output in zip(processes, outputs, strict=True)]


def outputs_of_passed(runs: list[tuple[int, str]]) -> list[str]:
    """The outputs of :func:`run_together`'s processes, after checking that each exited 0."""
    for code, output in runs:
        assert code == 0, output[-6000:]
    return [output for _, output in runs]


def two_torchrun_agents(script: str, args: list[str], cwd: Path, timeout: float = 400) -> list[str]:
    """Run ``script`` as two nodes of two processes on this machine, one ``torchrun`` agent per node (static
    rendezvous, ``--node-rank``), as users launch two machines; each agent's output, after checking both exit 0."""
    port = free_port()
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(HERE / script),
         *args]
        for node in range(2)
    ]  # fmt: skip
    env = _environment() | {"OMP_NUM_THREADS": "1"}
    return outputs_of_passed(run_together(commands, [env, env], cwd, timeout))


def results(out: Path, world_size: int = 2) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world_size)]


def params(out: Path, rank: int) -> torch.Tensor:
    return torch.load(f"{out}.rank{rank}.params.pt", weights_only=True)


@dataclass
class Rank:
    """One separately launched rank: its process and where its output goes."""

    process: subprocess.Popen | Forked
    stdout: Path
    stderr: Path

    def output(self) -> tuple[str, str]:
        return self.stdout.read_text(), self.stderr.read_text()

    def stop(self) -> None:
        """Kill the process if it is still running (a stopped or hung rank), and reap it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def launch_ranks(
    script: str, out: Path, *args: str, world_size: int = 2, launcher: str = "fork", per_node: int | None = None
) -> list[Rank]:
    """Start every rank of ``script`` as its own process, as torchrun or srun do (no Lightning launcher):
    forked from the zygote (``launcher="fork"``) or as fresh interpreters (``"external"``).

    Each process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` and ``NODE_RANK``,
    which makes Lightning treat the processes as created externally: one node, or nodes of ``per_node`` ranks
    numbered node by node. The caller waits for them (and kills what is left: a stopped rank stays stopped).
    """
    if launcher not in ("fork", "external"):
        raise ValueError(f"launch_ranks starts ranks by 'fork' or 'external', not {launcher!r}")
    port = free_port()
    ranks = []
    for rank in range(world_size):
        env = _environment() | {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
            "RANK": str(rank), "LOCAL_RANK": str(rank % (per_node or world_size)),
            "NODE_RANK": str(rank // (per_node or world_size)),
        }  # fmt: skip
        stdout, stderr = Path(f"{out}.rank{rank}.stdout"), Path(f"{out}.rank{rank}.stderr")
        if launcher == "fork":
            ranks.append(Rank(_fork(script, out, args, env, stdout, stderr), stdout, stderr))
            continue
        with stdout.open("w") as o, stderr.open("w") as e:
            process = subprocess.Popen(
                _command(script, out, args), env=env, cwd=out.parent, stdout=o, stderr=e, text=True,
            )  # fmt: skip
        ranks.append(Rank(process, stdout, stderr))
    return ranks


class Forked:
    """A process forked by the zygote, with the part of :class:`subprocess.Popen`'s interface the tests use.

    It is the zygote's child, not this process's: the zygote reaps it and reports its return code over
    this rank's connection.
    """

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self._conn, self._buffer = conn, b""
        self.args = args
        self.returncode: int | None = None
        pid = self._line(timeout=60)
        if pid is None:
            raise RuntimeError(f"the test zygote did not fork {args}: see {_zygote_log()}")
        self.pid = int(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._result(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._result(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def _result(self, timeout: float | None) -> bool:
        line = self._line(timeout)
        if line is not None:
            self.returncode = int(line)
            self._conn.close()
        return line is not None

    def _line(self, timeout: float | None) -> str | None:
        """The next line from the zygote, or None if none came within ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(
                    f"the test zygote stopped before reporting process {self.args}: see {_zygote_log()}"
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


_ZYGOTE: dict[str, object] = {}
# Variables the zygote's imports read (OpenMP at torch's import, Python at start): a run whose environment
# sets them otherwise than the zygote's starts fresh interpreters.
_READ_AT_START = ("OMP_", "KMP_", "MKL_", "GOMP_", "PYTHON", "LD_", "TORCH_", "PL_", "CUDA_")


def _start_zygote() -> tuple[subprocess.Popen, str, dict[str, str]]:
    zygote = _ZYGOTE.get("process")
    if isinstance(zygote, subprocess.Popen) and zygote.poll() is None:
        return zygote, str(_ZYGOTE["socket"]), _ZYGOTE["env"]  # type: ignore[return-value]
    folder = tempfile.mkdtemp(prefix="lightning_dgc_zygote_")
    path, env = os.path.join(folder, "socket"), _environment()
    with open(os.path.join(folder, "log"), "w") as log:
        zygote = subprocess.Popen(
            [sys.executable, str(HERE / "zygote.py"), path], env=env, cwd=ROOT, stdin=subprocess.PIPE,
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    atexit.register(_stop_zygote, zygote, folder)
    _ZYGOTE.update(process=zygote, socket=path, env=env, log=os.path.join(folder, "log"))
    return zygote, path, env


def _stop_zygote(zygote: subprocess.Popen, folder: str) -> None:
    """Close the zygote's stdin: it kills the ranks it has left and exits."""
    if zygote.stdin is not None:
        zygote.stdin.close()
    try:
        zygote.wait(timeout=10)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _zygote_log() -> str:
    return str(_ZYGOTE.get("log"))


def _fork(script: str, out: Path, args: tuple[str, ...], env: dict[str, str], stdout: Path, stderr: Path):
    """One rank forked from the zygote (started on first use); a fresh interpreter instead if the environment
    differs from the zygote's in what is read at start, or if ``LIGHTNING_DGC_TEST_FORK=0`` is set."""
    command = _command(script, out, args)
    if os.environ.get("LIGHTNING_DGC_TEST_FORK", "1") != "0":
        zygote, path, zygote_env = _start_zygote()
        started = {*env, *zygote_env}
        if all(env.get(k) == zygote_env.get(k) for k in started if k.startswith(_READ_AT_START)):
            return _ask_zygote(zygote, path, command, env, out, stdout, stderr)
    with stdout.open("w") as o, stderr.open("w") as e:
        return subprocess.Popen(command, env=env, cwd=out.parent, stdout=o, stderr=e, text=True)


def _ask_zygote(
    zygote: subprocess.Popen, path: str, command: list[str], env: dict[str, str], out: Path, stdout: Path,
    stderr: Path,
) -> Forked:  # fmt: skip
    request = {"script": command[1], "argv": command[2:], "env": env, "cwd": str(out.parent),
               "stdout": str(stdout), "stderr": str(stderr)}  # fmt: skip
    deadline = time.monotonic() + 300  # the zygote's own imports
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if zygote.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test zygote did not start: see {_zygote_log()}") from None
            time.sleep(0.05)
    conn.sendall((json.dumps(request) + "\n").encode())
    return Forked(conn, command)
