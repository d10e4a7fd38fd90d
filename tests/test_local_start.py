"""`atd local up` decides "exited at start" from the daemon's exit status and "ready" from the
daemon's own signal (daemon.json with its pid + a control-socket status), never from reading
the process's /proc entries, which a live daemon can fail while it starts.

The race that was seen (about 1 `up` in 10): `/proc/PID/cmdline` is empty for a moment after
`Popen` returns (exec has closed the close-on-exec pipe but not yet set up the new image's
arguments), and the old check took "no `node start HOME` in the command line" for "exited".
That window is a matter of scheduling; the test below makes it long and certain instead."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from atdnode.node import LocalNetError, localnet
from atdnode.node import daemon_proc

# A launcher that starts slowly and, while it does, shows no command line in /proc (it blanks
# its arguments in place, as setproctitle does), then becomes `python -m cli.app ARGS`.
SLOW_START = r'''
import os, sys, time
fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
arg_start, arg_end = int(fields[45]), int(fields[46])  # stat fields 48, 49
keep = len(os.fsencode(sys.orig_argv[0])) + 1
with open("/proc/self/mem", "r+b", buffering=0) as mem:
    mem.seek(arg_start + keep)
    mem.write(b"\0" * (arg_end - arg_start - keep))
time.sleep(float(os.environ.get("ATD_TEST_SLOW_START", "2")))
os.execv(sys.executable, [sys.executable, "-m", "cli.app", *sys.argv[1:]])
'''


def _launcher(tmp_path: Path, monkeypatch, code: str) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(code)
    monkeypatch.setattr(daemon_proc, "atd_argv", lambda: [sys.executable, str(script)])


@pytest.mark.slow
def test_a_slow_start_that_hides_its_command_line_is_waited_for(tmp_path, monkeypatch):
    """Fails without the fix: the old check read the process's command line during the
    start, found no `node start HOME` and reported the live daemon as "exited at start"."""
    _launcher(tmp_path, monkeypatch, SLOW_START)
    root = tmp_path / "c"
    try:
        nodes = localnet.up(root, 1, timeout=120)
        assert nodes[0].running and nodes[0].addrs and nodes[0].pid is not None
    finally:
        assert localnet.down(root) == {"node1": "stopped"}


def test_a_start_that_dies_reports_its_own_status_and_output(tmp_path, monkeypatch):
    root = tmp_path / "c"
    localnet.up(root, 1, start=False)
    out = root / "node1" / "logs" / "daemon.out"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("error: an old failure of an earlier start\n")
    _launcher(tmp_path, monkeypatch, "import sys; print('error: bad things'); sys.exit(3)")
    with pytest.raises(LocalNetError, match=r"node1: the daemon exited at start \(status 3; .*\): error: bad things"):
        localnet.up(root, timeout=60)
    _launcher(tmp_path, monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(LocalNetError, match=r"exited at start \(signal 9; ") as exc:
        localnet.up(root, timeout=60)
    assert "old failure" not in str(exc.value) and "bad things" not in str(exc.value)  # only this start's output
    assert localnet.down(root) == {"node1": "had exited (stale pidfile removed)"}
