"""`atd` commands forked from one warm interpreter, for tests that run many of them as a
user would (the README walkthroughs): `cli.app.run(argv)` in a fresh child process with the
caller's arguments, working directory, environment and stdin/stdout/stderr, and its exit code.

Why: an `atd` command that trains, aggregates or classifies spends 5-6 CPU-seconds importing
torch, timm (which pulls torchvision and torch._dynamo), scikit-learn and matplotlib before
it does anything, and it uses all of them (measured per command with `python -X importtime`).
The VGS walkthrough runs 14 such commands: ~80 of its ~110 CPU-seconds were imports. Here
they are imported once; each command still runs in its own process (a fork), from the same
`cli.app.run` the console script calls, so its exit code, output and files are the command's.
What this does not exercise is the cold start of the console script itself:
tests/test_module_shape.py (which modules each command imports) and the `atd` subprocess
tests of tests/nodeprocs.py do.

Protocol (one connection per command, a Unix socket): the client sends one JSON line
{argv, cwd, env} with its fds 0, 1, 2 attached (SCM_RIGHTS); the server forks; the child
takes the fds, directory and environment, runs the command, flushes, writes its exit code
as one line and `os._exit`s with it; the child dies (SIGKILL) when the client dies first, so
killing the client kills the command. The server is single-threaded (it forks, so it must
be), reaps its children, and stops when its socket file is removed (killing and reaping the
commands still running) or when it is killed.

Use: `with forkserver(tmp_path) as client: ...` gives the argv prefix of a client (a
`bin/atd` shim execs it).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Iterator

# the client: stdlib only, started with `python -I -S` (~20 ms), so it costs nothing
CLIENT = r'''
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
msg = json.dumps({"argv": sys.argv[2:], "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n"
socket.send_fds(s, [msg], [0, 1, 2])
data = b""
while not data.endswith(b"\n"):
    chunk = s.recv(64)
    if not chunk:
        sys.stderr.write("atd forkserver: the command died without an exit code\n")
        sys.exit(255)
    data += chunk
sys.exit(int(data))
'''

# what the commands of the walkthroughs import on their way (lazily, where they need it)
WARM = ("cli.app", "torch", "timm", "atdnode.learning.model", "atdnode.learning.training", "atdnode.learning.classify",
        "atdnode.aggregation.modes", "atdnode.aggregation.verify", "sklearn.datasets", "sklearn.metrics",
        "sklearn.calibration", "sklearn.decomposition", "sklearn.ensemble", "sklearn.frozen",
        "sklearn.model_selection", "sklearn.neural_network", "sklearn.preprocessing", "sklearn.svm")

# what the commands that load no torch import (`atd local`, `ledger`, `member`, `key`, `config`,
# `node status`): the CLI alone (~0.7 s of CPU per cold start, nothing per fork)
CLI_ONLY = ("cli.app",)


def _die_with_client(conn: socket.socket) -> None:
    """In the forked child: SIGKILL this process once the client's end of `conn` closes
    before the exit code was sent (the client was killed: the command dies with it, as a
    command killed with -9 does). The client sends nothing after its request, so `recv`
    returns only when the client is gone."""
    def watch() -> None:
        with contextlib.suppress(OSError):
            if not conn.recv(1):
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def _run_child(conn: socket.socket, fds: list[int], req: dict) -> None:
    """In the forked child: become the command's process, run it, report, exit. Killing the
    client kills the command (`_die_with_client`)."""
    code = 255
    try:
        _die_with_client(conn)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["atd", *req["argv"]]
        from cli.app import run

        code = run(req["argv"])
    except BaseException:  # the harness itself failed (run() never raises): say so, exit 255
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            conn.sendall(f"{code}\n".encode())
        os._exit(code)


def serve(path: str, warm: tuple[str, ...] = WARM) -> None:
    """Import `warm`, then accept commands on the Unix socket `path` until the file
    disappears or a signal ends it."""
    import importlib

    for name in warm:
        importlib.import_module(name)
    if warm == WARM:
        from atdnode.plots import pyplot

        pyplot()  # matplotlib.pyplot on the Agg back-end, as a command that draws imports it
    if "cli.app" in warm:
        from cli.app import click_command

        click_command()  # the command tree `run` builds once per process: built here, every fork has it
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    srv.settimeout(0.2)
    print("ready", flush=True)
    children: set[int] = set()
    while os.path.exists(path):
        with contextlib.suppress(ChildProcessError):
            while pid := os.waitpid(-1, os.WNOHANG)[0]:
                children.discard(pid)
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not msg.endswith(b"\n"):
            msg += conn.recv(1 << 20)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            srv.close()
            _run_child(conn, fds, json.loads(msg))
        children.add(pid)
        for fd in fds:
            os.close(fd)
        conn.close()
    # the socket is gone: a command still running is killed; every child is reaped, so the CPU
    # time of the commands counts in this process's (and so in its starter's) rusage
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


@contextlib.contextmanager
def forkserver(root: Path, env: dict[str, str], warm: tuple[str, ...] = WARM) -> Iterator[list[str]]:
    """Start a server under `root` with `env` that imported `warm`; yield the client's argv
    prefix (append the command's arguments); stop it (and any command still running) on exit."""
    sock = root / "atd.sock"
    if len(str(sock)) > 100:  # AF_UNIX paths are limited to ~108 bytes
        sock = Path(tempfile.mkdtemp(prefix="atdfs-")) / "atd.sock"
    client = root / "atd_client.py"
    client.write_text(CLIENT)
    with open(root / "forkserver.stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.atd_forkserver", str(sock), *warm], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line == "ready\n", f"forkserver did not start: {(root / 'forkserver.stderr').read_text()[-3000:]}"
        yield [sys.executable, "-I", "-S", str(client), str(sock)]
    finally:
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        if sock.parent != root:
            sock.parent.rmdir()
        try:  # it sees its socket gone within 0.2 s, kills and reaps what still runs, and exits
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


if __name__ == "__main__":
    serve(sys.argv[1], tuple(sys.argv[2:]))
