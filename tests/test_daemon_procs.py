"""Three `atd` daemons as separate OS processes on 127.0.0.1.

Each node trains a tiny ViT on its third of digits, publishes its extractor, node 1
aggregates all three horizontally, and all three ledgers verify and hold the same entries.
Then the faults: a node killed with -9 while another fetches its blob, and a node that was
offline while entries were published catches up when it returns.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from atdnode.blobs import BlobStore
from atdnode.node import NodeHome, NodeIdentity, control
from tests.factories import append, cli, cli_json, make_consortium, weights_body
from tests.atd_forkserver import forkserver
from tests.nodeprocs import _env, atd, atd_all, entry_ids, ledger_rows, live_status, start_daemon, start_daemons, status, wait_until

TINY = ["--model", "vit_tiny_patch16_224", "--img-size", "16", "--patch-size", "4", "--embed-dim", "32",
        "--depth", "1", "--heads", "2", "--epochs", "1", "--batch-size", "64", "--seed", "0"]

pytestmark = pytest.mark.slow


def holds_all(home: Path, n: int) -> bool:
    st = live_status(home)
    return not st["wanted"] and st["blobs"] >= n


def test_three_processes_train_publish_aggregate(tmp_path: Path) -> None:
    homes = [h.root for h in make_consortium(tmp_path, 3)]
    daemons = []
    try:
        daemons += start_daemons(homes)
        addr = status(homes[0])["addrs"][0]  # `atd node status` as a process once; polls below are in-process
        assert "/p2p/" in addr and addr.startswith("/ip4/127.0.0.1/tcp/") and addr in daemons[0].addrs
        # the three nodes train at once (as three hospitals would): three `atd train` processes
        # forked from one interpreter that imported torch and timm once (tests/atd_forkserver.py);
        # then publish, aggregate and verify (`atd publish-weights`, `aggregate`, `aggregate
        # --verify` run by typer's runner in this process: they read the home on disk and do not
        # talk to the daemon, and each start-up with torch and timm costs ~5 s of CPU; the same
        # commands as processes: test_readme)
        with forkserver(tmp_path, _env()) as warm:
            atd_all(*(["train", "--home", str(h), "--data", f"digits?shard={k}/3", *TINY]
                      for k, h in enumerate(homes, start=1)), prefix=warm)
        for h in homes:
            cli("publish-weights", "--home", str(h), "--part", "extractor")
        wait_until(lambda: len({e["body"]["blob"] for e in ledger_rows(homes[0], "weights")}) == 3,
                   120, "node 1 to learn all three weights entries")
        wait_until(lambda: holds_all(homes[0], 3), 180, "node 1 to fetch every published extractor")
        out = cli_json("aggregate", "--home", str(homes[0]), "--mode", "horizontal")
        assert len(out["inputs"]) == 3
        wait_until(lambda: entry_ids(homes[0]) == entry_ids(homes[1]) == entry_ids(homes[2]), 120,
                   "all three ledgers to hold the same entries")
        for h in homes:  # the `atd ledger verify` command, in-process (as a process: test_cli_ledger)
            cli("ledger", "verify", "--home", str(h))
        # the aggregate is checkable by a peer that holds the inputs
        wait_until(lambda: not live_status(homes[1])["wanted"], 180, "node 2 to fetch the blobs it lacks")
        assert "verifies" in cli("aggregate", "--home", str(homes[1]), "--verify", out["entry"])
        # the aggregate averaged exactly the three published extractors (one per node)
        weights = ledger_rows(homes[0], "weights")  # what `atd ledger show --kind weights --json` prints
        assert sorted(out["inputs"]) == sorted(e["id"] for e in weights) and len({e["author"] for e in weights}) == 3
    finally:
        for d in daemons:
            d.stop()


def test_offline_node_catches_up_and_killed_holder_does_not_stall_fetch(tmp_path: Path) -> None:
    homes = [h.root for h in make_consortium(tmp_path, 3)]
    daemons = {}
    try:
        daemons[0] = start_daemon(homes[0])
        addr = daemons[0].addrs[0]
        daemons[1] = start_daemon(homes[1], "--bootstrap", addr, "--no-auto-fetch")
        # node 3 is offline while node 1 publishes a 150 MB blob
        blob_file = tmp_path / "big.bin"
        blob_file.write_bytes(bytes(range(256)) * (600 * 1024))
        store = BlobStore(homes[0] / "blobs")
        blob = store.put_file(blob_file)
        append(NodeHome.at(homes[0]), "weights", weights_body(blob, store.manifest(blob).hash, store.size(blob)))
        # node 2 fetches it explicitly and becomes a second holder
        atd("fetch", "--home", str(homes[1]), blob)
        # node 3 comes back late: it catches up by sync and fetches even though node 1 dies
        daemons[2] = start_daemon(homes[2], "--bootstrap", addr, "--no-auto-fetch")
        wait_until(lambda: entry_ids(homes[2]) >= entry_ids(homes[0]), 60, "node 3 to catch up by sync")
        node1, node2 = (NodeIdentity.load(NodeHome.at(h)).peer_id for h in homes[:2])
        wait_until(lambda: node2 in live_status(homes[2])["peers"], 60, "node 3 to dial node 2 from its hello entry")
        # node 3 fetches from both holders (what `atd fetch` asks its daemon, here with the daemon's
        # report); node 1 is frozen (SIGSTOP) before the fetch starts, so whatever node 3 asks of it
        # is still outstanding when it is killed -9 once node 2's chunks are arriving: over loopback
        # a running node 1 could serve its whole share before any poll saw the download start
        box: dict = {}
        os.kill(daemons[0].pid, signal.SIGSTOP)

        def fetch() -> None:
            try:
                box["reply"] = control.call(NodeHome.at(homes[2]).control_socket, "fetch", blob=blob,
                                            timeout_s=120, timeout=150)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                box["error"] = exc

        fetcher = threading.Thread(target=fetch)
        fetcher.start()
        partial = homes[2] / "blobs" / "partial"
        wait_until(lambda: not fetcher.is_alive() or (partial.is_dir() and any(partial.iterdir())), 60,
                   "node 3's download to start")
        assert fetcher.is_alive(), box  # killed mid-download, or nothing shows failover
        daemons[0].kill()  # SIGKILL ends a stopped process too
        fetcher.join(180)
        assert "reply" in box, box.get("error")
        assert BlobStore(homes[2] / "blobs").get_bytes(blob) == blob_file.read_bytes()
        # failover shown: node 1 broke off mid-fetch, and node 2 served what it left
        report = box["reply"]["report"]
        assert node1 in report["failed_peers"], report
        assert report["chunks_from"].get(node2, 0) > 0, report
    finally:
        for d in daemons.values():
            if d.alive():
                d.stop()
