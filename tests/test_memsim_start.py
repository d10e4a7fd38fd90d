"""The 1,000-daemon simulation's start-up and reproducibility: a run is a
function of its seed; a connection pulls what the peer holds even right after another
pull (the pull a "recently synced" shortcut would skip); a no-op pull between ledgers in
step reads no heads map; member keys and heads maps are not duplicated per node."""
from __future__ import annotations

from pathlib import Path

import trio

from atdnode.replication.sync_digest import digest_vector, vector_of
from ledger import Ledger, Signer
from netsim.memnet import MemCluster, simulate
from netsim.memsim import churn_scenario
from netsim.scenario import NetworkSpec
from netsim.workload import run_gossip


def _run(root: Path, seed: int) -> dict:
    """A small churn run (bench/memsim_bench.py's scenario): what a run's choices decide."""
    s, _ = churn_scenario(12, "daemon", 6, seed=seed)
    t = s.topology
    cluster = MemCluster(root, s.node_names(), seed=s.seed, network=s.network, sync_interval=t.sync_interval_s,
                         poll_interval=t.poll_interval_s, max_peers=t.max_peers, established=True)
    out: dict = {}

    async def main() -> None:
        async with cluster.running():
            rep = await run_gossip(cluster, s)
            out["converged"] = rep.converged
            out["t"] = rep.time_to_converge_s
            out["now"] = trio.current_time()
            out["peers"] = {n: sorted(cluster.peers(n)) for n in cluster.names}
            out["pulls"] = {n: d.stats["sync_pulls"] for n, d in cluster.daemons.items()}

    simulate(main, seed=s.seed)
    return out


def test_a_run_repeats_with_its_seed_and_not_with_another(tmp_path: Path) -> None:
    """Same seed: the same connections, pulls and convergence time (the dialer's and the
    periodic sync's RNGs are seeded); another seed: other choices."""
    a, b, c = _run(tmp_path / "a", 5), _run(tmp_path / "b", 5), _run(tmp_path / "c", 6)
    assert a["converged"] and b["converged"] and c["converged"]
    assert a == b
    assert a["peers"] != c["peers"]


def test_a_connection_pulls_what_its_peer_holds_right_after_another_pull(tmp_path: Path) -> None:
    """n1 appends while cut off from n0 and n2 (its gossip reaches nobody) and periodic sync
    is off. n0 and n2 have just pulled from each other successfully when n1 connects: the
    pull on that new connection is the only way the entry reaches them, so a start-up
    shortcut that skipped a connection's pull after a recent successful one (or whenever
    the connecting peer had pulled from us) loses it."""
    c = MemCluster(tmp_path, ["n0", "n1", "n2"], seed=7, network=NetworkSpec(latency_ms=5), sync_interval=1e6,
                   poll_interval=0.1, established=True)

    async def main() -> None:
        async with c.running():
            await c.start("n0")
            await c.start("n2", bootstrap=["n0"])
            await c.start("n1", bootstrap=["n2", "n0"])
            with trio.fail_after(10):
                while not c.daemons["n1"].head_confirmed:  # it may sign and gossip at once
                    await trio.sleep(0.05)
            c.partition([["n0", "n2"], ["n1"]])
            for n in ("n0", "n2"):  # the cut breaks n1's connections
                await c.daemons["n1"].transport.disconnect(c.peer_ids[n])
            pid = c.peer_ids["n1"]
            seq = await c.append("n1", "metrics", {"k": 1})  # gossiped into the cut: reaches no one
            await trio.sleep(10.0)  # past any gossip history window (simulated time)
            for n in ("n0", "n2"):
                assert (await c.heads(n)).get(pid, 0) < seq
            for a, b in (("n0", "n2"), ("n2", "n0")):
                assert await c.daemons[a].replica.pull_from(c.peer_ids[b]) is not None  # a success just now
            before = {n: c.daemons[n].stats["sync_pulls"] for n in ("n0", "n2")}
            c.heal()
            for n in ("n0", "n2"):
                if c.peer_ids[n] not in c.peers("n1"):  # (its dialer may have been first)
                    await c.daemons["n1"].transport.connect(c.address(n))
            with trio.fail_after(30):
                for n in ("n0", "n2"):
                    while (await c.heads(n)).get(pid, 0) < seq:
                        await trio.sleep(0.05)
            for n in ("n0", "n2"):  # each pulled on the new connection
                assert c.daemons[n].stats["sync_pulls"] > before[n]

    simulate(main, seed=7)


def test_digest_vector_is_cached_until_any_connection_writes(tmp_path: Path) -> None:
    """In step, a pull's digest costs no heads read (the same cached map comes back); a write
    through this connection or another one (a CLI command) moves the vector."""
    signer, other = Signer.from_seed(b"\x01" * 32), Signer.from_seed(b"\x02" * 32)
    path = tmp_path / "l.db"
    with Ledger.open(path) as led:
        led.create_genesis(signer, "c", [(other.public_key, False)])
        v1, h1 = digest_vector(led)
        v2, h2 = digest_vector(led)
        assert v1 == v2 == vector_of(led.heads()) and h2 is h1  # unchanged: the cached map itself
        led.append(signer, "metrics", {"k": 1})
        v3, h3 = digest_vector(led)
        assert v3 != v1 and v3 == vector_of(led.heads())
        with Ledger.open(path) as cli:  # another connection, as a CLI command writes
            cli.append(other, "metrics", {"k": 2})
        v4, _ = digest_vector(led)
        assert v4 != v3 and v4 == vector_of(led.heads())


def test_ledgers_share_member_key_objects_and_the_digest_keeps_the_ledgers_heads(tmp_path: Path) -> None:
    """Memory per node flat in N: two ledgers (two simulated nodes of one
    process) hold one bytes object per member key in their heads maps, not one each; the
    digest cache keeps the ledger's own heads map, not a second copy."""
    signer, other = Signer.from_seed(b"\x03" * 32), Signer.from_seed(b"\x04" * 32)
    with Ledger.open(tmp_path / "a.db") as a, Ledger.open(tmp_path / "b.db") as b:
        a.create_genesis(signer, "c", [(other.public_key, False)])
        b.merge(a.raw_rows())
        b.append(other, "metrics", {"k": 1})
        ha, hb = a.heads(), b.heads()
        assert set(ha) == {signer.public_key} and set(hb) == {signer.public_key, other.public_key}
        ka = next(iter(ha))
        kb = next(k for k in hb if k == ka)
        assert ka is kb  # one shared object, though each came from its own SQLite row
        _, heads = digest_vector(b)
        assert heads is b.heads(copy=False) and heads == hb


def test_the_convergence_poll_rereads_only_changed_ledgers_and_misses_no_change(tmp_path: Path, monkeypatch) -> None:
    """`MemCluster.heads(name, authors)` (the harness's convergence poll) reads a running
    node's ledger again only after it was written, and every write shows at the next poll:
    a gossiped entry merged by the daemon, and an entry another connection of this process
    (a CLI command) wrote into that ledger."""
    c = MemCluster(tmp_path, ["n0", "n1", "n2"], seed=3, network=NetworkSpec(latency_ms=5), sync_interval=1e6,
                   poll_interval=0.1, established=True)
    reads: list[str] = []
    heads_of = Ledger.heads_of
    monkeypatch.setattr(Ledger, "heads_of", lambda led, authors: reads.append(led.path) or heads_of(led, authors))

    async def main() -> None:
        async with c.running():
            await c.start("n0")
            await c.start("n1", bootstrap=["n0"])
            with trio.fail_after(10):
                while not (c.daemons["n0"].head_confirmed and c.daemons["n1"].head_confirmed):
                    await trio.sleep(0.05)
            pids = [c.peer_ids[n] for n in c.names]

            async def fresh() -> dict:  # every head, read without the kept answers
                return {p: s for p, s in (await c.heads("n0")).items() if p in pids}

            first = await c.heads("n0", pids)
            assert first == await fresh()
            n = len(reads)
            assert await c.heads("n0", pids) == first and await c.heads("n0", pids[1:]) == {
                p: s for p, s in first.items() if p in pids[1:]}
            assert len(reads) == n  # unchanged ledger: no read
            seq = await c.append("n1", "metrics", {"k": 1})  # gossiped to n0, merged by its daemon
            with trio.fail_after(10):
                while (await c.heads("n0", pids)).get(c.peer_ids["n1"], 0) < seq:
                    await trio.sleep(0.05)
            assert await c.heads("n0", pids) == await fresh() and len(reads) > n
            with Ledger.open(c.c.homes["n0"].ledger_db) as cli:  # another connection writes n2's entry
                cli.append(Signer.from_seed(c.c.seeds["n2"]), "metrics", {"k": 2})
            got = await c.heads("n0", pids)
            assert got.get(c.peer_ids["n2"], 0) >= 1 and got == await fresh()

    simulate(main, seed=3)
