"""`atd node start` as an OS process: config.toml's listen/bootstrap, a busy home, a busy
port, malformed and unreachable addresses. Each failure is one line; waits use readiness
signals (the daemon announcing itself, a log line), never fixed sleeps."""
from __future__ import annotations

import errno
import socket

import pytest

from atdnode.node import NodeConfig, NodeHome
from ledger import Signer, peer_id_from_public_key
from tests.factories import cli
from tests.nodeprocs import atd, spawn_daemon, start_daemon, wait_until

pytestmark = pytest.mark.slow


def _one_line_error(proc, want: str) -> None:
    assert proc.returncode not in (0, None), (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and want in proc.stderr, proc.stderr


def _set_config(home, **changes) -> None:
    h = NodeHome.at(home)
    cfg = NodeConfig.load(h)
    for k, v in changes.items():
        setattr(cfg, k, v)
    cfg.save(h)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def homes(tmp_path_factory):
    root = tmp_path_factory.mktemp("start")
    a, b = root / "a", root / "b"
    # the homes as `atd` makes them, in-process (what is tested here is `atd node start`'s process)
    cli("init", "--home", str(a), "--genesis", "--consortium", "c")
    genesis = cli("ledger", "show", "--home", str(a), "--kind", "genesis", "--json").split('"id": "')[1][:64]
    pb = cli("init", "--home", str(b), "--join", genesis).strip().splitlines()[-1]  # its peer id
    cli("member", "add", "--home", str(a), pb)
    return a, b


def test_config_listen_busy_home_and_exclusive_port(homes):
    a, b = homes
    port = _free_port()
    _set_config(a, listen=[f"/ip4/127.0.0.1/tcp/{port}"])
    d = spawn_daemon(a)  # no --listen: config.toml's listen
    try:
        addr = d.wait_ready(90)[0]
        assert addr.startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooW"), addr
        # a second daemon on the same home
        _one_line_error(atd("node", "start", "--home", str(a), check=False), "a daemon already runs")
        # nobody can bind the daemon's port beside it, not even with SO_REUSEPORT
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError) as exc, s:
            s.bind(("127.0.0.1", port))
            s.listen()
        assert exc.value.errno == errno.EADDRINUSE
        # another node asked to listen on that port stops with one line
        _one_line_error(atd("node", "start", "--home", str(b), "--listen", f"/ip4/127.0.0.1/tcp/{port}", check=False),
                        "another process listens on this port")
        # ... and its log keeps the traceback for IT (stderr had only the one line)
        assert "daemon stopped by an error" in (b / "logs" / "daemon.log").read_text()
    finally:
        assert d.stop() == "stopped" and d.returncode == 0
        _set_config(a, listen=["/ip4/127.0.0.1/tcp/0"])
    # the stop was clean: daemon.json removed, the ledger closed (its WAL checkpointed into ledger.db)
    assert not (a / "daemon.json").exists()
    assert not NodeHome.at(a).ledger_db.with_suffix(".db-wal").exists()


@pytest.mark.parametrize("flag,bad,want", [
    ("--listen", "bogus", "--listen 'bogus': not a multiaddr"),
    ("--listen", "/ip4/127.0.0.1", "expected /ip4/ADDR/tcp/PORT"),
    ("--bootstrap", "/ip4/127.0.0.1/tcp/4001", "expected /ip4/HOST/tcp/PORT/p2p/PEER_ID"),
    ("--bootstrap", "/ip4/127.0.0.1/tcp/4001/p2p/notapeer", "--bootstrap"),
])
def test_bad_addresses_are_refused_at_once(homes, flag, bad, want):
    _one_line_error(atd("node", "start", "--home", str(homes[1]), flag, bad, check=False, timeout=120), want)


def test_malformed_config_bootstrap_names_config_toml(homes):
    _, b = homes
    _set_config(b, bootstrap=["/ip4/127.0.0.1/tcp/1"])
    try:
        _one_line_error(atd("node", "start", "--home", str(b), check=False), "config.toml bootstrap")
    finally:
        _set_config(b, bootstrap=[])


def test_config_bootstrap_is_dialled_and_unreachable_peers_reported_within_seconds(homes):
    a, b = homes
    da = start_daemon(a)
    try:
        pa = da.addrs[0].rsplit("/p2p/", 1)[1]
        nobody = peer_id_from_public_key(Signer.from_seed(b"z" * 32).public_key)
        dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{nobody}"  # nothing listens there
        hole = socket.socket()  # accepts TCP (the kernel's backlog) but never answers: a dial hangs
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        other = peer_id_from_public_key(Signer.from_seed(b"y" * 32).public_key)  # (dials to one peer queue up)
        silent = f"/ip4/127.0.0.1/tcp/{hole.getsockname()[1]}/p2p/{other}"
        _set_config(b, bootstrap=[dead, silent, da.addrs[0]])
        db = spawn_daemon(b, "--listen", "/ip4/127.0.0.1/tcp/0")  # no --bootstrap: config.toml's
        try:
            db.wait_ready(90)
            wait_until(lambda: f"could not reach bootstrap {dead}: dialing" in db.output(), 20,
                       "the refused bootstrap dial to be reported with its reason")
            # reported after 5 s of silence, before the 15 s dial timeout
            wait_until(lambda: f"could not reach bootstrap {silent} within 5 s" in db.output(), 12,
                       "the silent bootstrap peer to be reported")
            wait_until(lambda: pa in atd("peers", "--home", str(b)).stdout, 60, "b to connect to a via config.toml")
        finally:
            db.stop()
            hole.close()
    finally:
        da.stop()
        _set_config(b, bootstrap=[])
