"""A fork server for the test scripts' ranks: imports torch, Lightning and lightning_dgc once, then forks one
process per rank, which runs its script as ``__main__`` (``tests/lightning/run.py`` starts and talks to it).

A fresh interpreter spends about 5 s of CPU importing torch and Lightning; a forked one starts in
milliseconds. This process starts no thread, process group or OpenMP pool before it forks (importing does
none of these), so each child starts as a fresh interpreter would, except that it shares this process's
``hash()`` salt: a test that needs ranks with their own salt starts fresh interpreters instead.

    python tests/lightning/zygote.py SOCKET_PATH

Protocol, one connection per rank: the client sends one JSON line ``{"script", "argv", "env", "cwd",
"stdout", "stderr"}``; the server answers the child's pid, then, once the child is reaped, its return code
(negative: killed by that signal, as :class:`subprocess.Popen` reports it), one line each. The server stops,
killing the children it has left, when its stdin closes (the pytest run is over).
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import sys

import lightning  # noqa: F401  (the imports every script pays for, done once)
import lightning.pytorch  # noqa: F401
import torch
from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

import lightning_dgc  # noqa: F401
import tests.lightning.fit_script  # noqa: F401  (the model and data most scripts import)


def serve(path: str) -> dict:
    """Accept requests until stdin closes; return in a forked child only, with its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):  # the test session is over
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    sys.exit(0)
                continue
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child keeps none of the server's sockets
                selector.close()
                for sock in (listener, conn, *children.values()):
                    sock.close()
                return request
            children[pid] = conn
            conn.sendall(f"{pid}\n".encode())
        while children:  # reap every child that has ended and report its return code
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the client is gone
                pass
            conn.close()


def become(request: dict) -> None:
    """Turn this forked child into the script's process: its files, directory, environment and argv."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP when torch was imported here: apply it again
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rank_zero_only.rank = _get_rank() or 0  # what Lightning read from RANK & co. at its import
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = os.path.dirname(request["script"])  # as `python SCRIPT` sets it


def main() -> None:
    import runpy

    # What the imports built stays shared with the children, untouched: the collector (which Lightning and
    # lightning_dgc run at exit) would otherwise write to, and so copy, every page of it in each child.
    gc.collect()
    gc.freeze()
    request = serve(sys.argv[1])
    become(request)
    # What follows runs in the child only; its exit (atexit handlers, flushing) is the interpreter's.
    runpy.run_path(request["script"], run_name="__main__")


if __name__ == "__main__":
    main()
