"""Acceptance: outsiders bootstrapped to a member, as OS processes, get nothing.

A founder holds a weights blob. A never-admitted node and a revoked node (admitted, then
revoked before it ever ran) are real `atd node start` daemons bootstrapped to the founder;
a member beside them bootstraps the same way. The member syncs and fetches the blob over
the encrypted bulk channel as before; the outsiders end with nothing beyond the genesis
entry and no blob, and none of their entries is stored by the founder.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from atdnode.node import control
from atdnode.blobs import BlobStore
from atdnode.node import NodeHome, NodeIdentity
from ledger import Ledger
from tests.nodeprocs import start_daemon, wait_until
from tests.factories import cli, weights_body


def _kinds(home: Path) -> list[str]:
    with Ledger.open(home / "ledger.db") as led:
        return [e.kind for e in led.all_entries()]


def _ids(home: Path) -> set[bytes]:
    with Ledger.open(home / "ledger.db") as led:
        return {e.id for e in led.all_entries()}


def _status(home: Path) -> dict:
    return control.call(NodeHome.at(home).control_socket, "status")


@pytest.mark.slow  # daemons as OS processes
def test_never_admitted_and_revoked_nodes_get_nothing(tmp_path: Path) -> None:
    f, m, o, r = (tmp_path / n for n in ("founder", "member", "outsider", "revoked"))
    cli("init", "--home", str(f), "--genesis", "--consortium", "closed")
    with Ledger.open(f / "ledger.db") as led:
        genesis = led.query(kind="genesis")[0]
    for h in (m, o, r):
        cli("init", "--home", str(h), "--join", genesis.id.hex())
    peer = {h: NodeIdentity.load(NodeHome.at(h)).peer_id for h in (m, o, r)}
    for h in (m, r):
        cli("member", "add", "--home", str(f), peer[h])
    cli("member", "revoke", "--home", str(f), peer[r])
    # the founder's weights blob and its signed entry
    store = BlobStore(NodeHome.at(f).blobs_dir)
    blob = store.put_bytes(random.Random(9).randbytes(3 << 20))
    with Ledger.open(f / "ledger.db") as led:
        led.append(NodeIdentity.load(NodeHome.at(f)).signer, "weights",
                   weights_body(blob, store.manifest(blob).hash, store.size(blob), part="extractor"))
    outsiders = {NodeIdentity.load(NodeHome.at(h)).public_key for h in (o, r)}

    umask = os.umask(0o022)  # the daemons inherit a permissive umask: they must make their files private
    daemons = [start_daemon(f)]
    try:
        addr = daemons[0].addrs[0]
        daemons += [start_daemon(h, "--bootstrap", addr) for h in (o, r, m)]
        wait_until(lambda: BlobStore(NodeHome.at(m).blobs_dir).has(blob), 120, "the member fetches the blob")
        wait_until(lambda: _ids(f) <= _ids(m), 60, "the member has the founder's log")
        # give the outsiders several sync rounds (--sync-interval 2) with the founder
        pulls = _status(f)["stats"]["sync_pulls"]
        wait_until(lambda: _status(f)["stats"]["sync_pulls"] >= pulls + 3, 60, "three more sync rounds on the founder")
        wait_until(lambda: {peer[o], peer[r]} <= set(_status(f)["refused"]), 60, "the founder refused both")
        for h in (o, r):
            assert _kinds(h) in ([], ["genesis"]), f"{h.name} got {_kinds(h)}"
            assert not BlobStore(NodeHome.at(h).blobs_dir).list(), f"{h.name} got a blob"
        assert peer[m] in _status(f)["peers"]
    finally:
        for d in daemons:
            d.stop()
        os.umask(umask)
    with Ledger.open(f / "ledger.db") as led:
        stats = led.stats()
        assert stats["held"] == 0 and stats["evidence"] == 0
        rows = led._store.conn.execute("SELECT author FROM entries").fetchall()
        assert not outsiders & {a for (a,) in rows}  # nothing of theirs is stored, not even held
    # what the daemons wrote (ledger.db-wal, logs/daemon.log, blobs) is private too
    for h in (f, m):
        for p in [h, *h.rglob("*")]:
            if not p.is_socket() and p.name != "test-daemon.stderr":  # that one is the test harness's
                assert p.stat().st_mode & 0o777 == (0o700 if p.is_dir() else 0o600), f"{p} is {p.stat().st_mode:o}"
