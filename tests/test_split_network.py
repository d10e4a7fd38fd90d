"""Split learning over the network: real daemons, ledgers and protocol servers;
the in-memory transport for the sessions and faults, real OS processes on 127.0.0.1 for
the acceptance run. Tiny settings: 16 px digits, 4 px patches, 32 wide, 2 blocks.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import trio

from atdnode.node import NodeConfig, NodeHome, NodeIdentity
from atdnode.split import SPLIT_PROTOCOL
from atdnode.split import (JoinOptions, RemoteError, SplitConfigError, SplitJoinError, SplitSettings,
                           finetune_from_entry, load_records, parse_task, report_row, run_join, single_error)
from atdnode.split.session import SplitChannel
from atdnode.transport import MemoryNetwork, MemoryTransport, StreamClosed, TransportError
from ledger import Ledger
from protocols.comm_cost import ByteCounter
from tests.atd_forkserver import forkserver
from tests.factories import daemon_on, make_consortium, wait_for
from tests.nodeprocs import _env, start_daemon
from tests.splitnet import BASE, TOKENS, check_record, client, configure, data, majority_rate

torch.set_num_threads(1)

def test_pfesta_two_tasks_over_the_network(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    configure(homes[0], "pfesta-server")
    net = MemoryNetwork(seed=11)
    results: dict = {}

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            svc = server.services[0]

            async def go(name, home, task, spec):
                results[name] = await client(net, home, server, task, spec)

            async with trio.open_nursery() as clients:
                clients.start_soon(go, "a", homes[1], "digit", data(1))
                clients.start_soon(go, "b", homes[2], "ink", data(2))
            assert svc.board.done and svc.board.completed == 2
            server.stop()

    trio.run(main)
    a, b = results["a"], results["b"]
    assert set(a.metrics) == {"accuracy"} and set(b.metrics) == {"patch_accuracy", "patch_majority"}
    assert b.metrics["patch_accuracy"] > b.metrics["patch_majority"] + 0.05  # above predicting the majority value
    for res in (a, b):
        row = check_record(res, "pfesta")
        c = ByteCounter.from_dict(res.record["counter"])
        cid = res.record["client"]
        # each sample's permuted embeddings went up exactly once; R*B samples of body output down
        assert c.total(cid, "up", ["upload"], payload=True) == 120 * TOKENS[0] * TOKENS[1] * 4
        assert c.messages(cid, ["body_out"]) == c.messages(cid, ["grad_out"]) == 2 * 3
        assert c.messages(cid, ["state_up"]) == c.messages(cid, ["state_down"]) == 2
        assert row["measured"] < row["T_FESTA"]  # p-FESTA's saving at this setting
        assert res.record["service_entry"] is not None  # the client checked the signed offer
    # the server counted the same training bytes per client as the client did
    server_rows = {r["client"]: r for r in map(report_row, load_records(homes[0]))}
    for res in (a, b):
        mine = report_row(res.record)
        theirs = server_rows[res.record["client"]]
        assert theirs["side"] == "server" and theirs["measured"] == mine["measured"]
        assert theirs["params"] == mine["params"]
    led = Ledger.open(homes[1].ledger_db)  # the client's ledger learned the signed offer by sync
    try:
        (svc_entry,) = led.query(kind="service")
    finally:
        led.close()
    assert svc_entry.body["algorithm"] == "pfesta" and svc_entry.body["protocol"] == SPLIT_PROTOCOL
    assert [t["name"] for t in svc_entry.body["tasks"]] == ["digit", "ink", "severity"]


def test_festa_multitask_with_frozen_phase2(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    configure(homes[0], "festa-server", phase2_rounds=1)
    net = MemoryNetwork(seed=12)
    results: dict = {}

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            svc = server.services[0]

            async def go(name, home, task, spec):
                results[name] = await client(net, home, server, task, spec)

            async with trio.open_nursery() as clients:
                clients.start_soon(go, "a", homes[1], "digit", data(1))
                clients.start_soon(go, "b", homes[2], "severity", data(2))
            srv = svc.campaign.server
            assert srv.frozen and svc.board.completed == 3
            events = [e["event"] for e in srv.events]
            assert events.count("unify") == 3 * 2 and "freeze" in events
            server.stop()

    trio.run(main)
    a, b = results["a"], results["b"]
    assert set(a.metrics) == {"accuracy"} and set(b.metrics) == {"mse"}
    for res in (a, b):
        check_record(res, "festa")
        c = ByteCounter.from_dict(res.record["counter"])
        cid = res.record["client"]
        for kind in ("forward", "body_out", "grad_out", "grad_in"):
            assert c.messages(cid, [kind]) == 3 * 3
        assert res.record["rounds"] == [1, 2, 3] and res.record["params"]["R"] == 3


def test_vanished_and_silent_clients_do_not_stall_the_server(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 4)
    configure(homes[0], "festa-server", clients=3, round_timeout=3.0, rounds=2, steps_per_round=2)
    net = MemoryNetwork(seed=13)
    results: dict = {}

    async def rogue(home: NodeHome, server, *, vanish: bool) -> None:
        """Join, send one forward, read its body output, then reset (vanish) or go silent."""
        t = MemoryTransport(net, NodeIdentity.load(home).signer.seed)
        async with t.run([]):
            stream = await t.open_stream(server.transport.peer_id, SPLIT_PROTOCOL)
            ch = SplitChannel(stream, ByteCounter(), t.peer_id, side="client", max_frame=1 << 24)
            await ch.send("join", None, {"task": "digit", "num_samples": 50})
            assert (await ch.recv("welcome")).meta["next_round"] == 1
            await ch.send("forward", {"x": torch.zeros(4, *TOKENS)}, {"task": "digit", "round": 1})
            await ch.recv("body_out")
            if vanish:
                await stream.reset()
                return
            with pytest.raises(RemoteError, match="round 1"):  # silent: dropped at the deadline, told why
                await ch.recv()

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            svc = server.services[0]

            async def good():
                results["a"] = await client(net, homes[1], server, "digit", data(1))

            t0 = trio.current_time()
            async with trio.open_nursery() as clients:
                clients.start_soon(good)
                clients.start_soon(lambda: rogue(homes[2], server, vanish=True))
                clients.start_soon(lambda: rogue(homes[3], server, vanish=False))
            took = trio.current_time() - t0
            dropped = svc.campaign.server.dropped
            ids = [NodeIdentity.load(h).peer_id for h in homes[2:]]
            assert dropped[ids[0]]["reason"].startswith("disconnected") and dropped[ids[0]]["round"] == 1
            assert "round 1" in dropped[ids[1]]["reason"]
            # both were dropped in round 1 (above); a server that waited on either would never
            # finish. One 3 s deadline plus 2 x 2 tiny steps: ~4 s idle; 30 s is for a loaded CI box
            assert svc.board.completed == 2 and took < 30, took
            server.stop()

    trio.run(main)
    assert results["a"].record["rounds"] == [1, 2] and "accuracy" in results["a"].metrics


def test_malformed_frame_closes_only_that_clients_stream(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    configure(homes[0], "pfesta-server", clients=1, rounds=2, steps_per_round=2)
    net = MemoryNetwork(seed=14)
    results: dict = {}

    async def garbler(home: NodeHome, server) -> None:
        t = MemoryTransport(net, NodeIdentity.load(home).signer.seed)
        async with t.run([]):
            stream = await t.open_stream(server.transport.peer_id, SPLIT_PROTOCOL)
            ch = SplitChannel(stream, ByteCounter(), t.peer_id, side="client", max_frame=1 << 24)
            await ch.send("join", None, {"task": "ink", "num_samples": 40})
            await ch.recv("welcome")
            await stream.write_frame(b"ATF1\x00\x00\x00\x05junk!")  # a frame header promising garbage
            with pytest.raises(RemoteError, match="malformed"):
                await ch.recv()
            with pytest.raises((StreamClosed, TransportError)):
                await ch.recv()

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            svc = server.services[0]

            async def good():
                results["a"] = await client(net, homes[1], server, "digit", data(1))

            async with trio.open_nursery() as clients:
                clients.start_soon(good)
                clients.start_soon(garbler, homes[2], server)
            bad = NodeIdentity.load(homes[2]).peer_id
            assert svc.campaign.server.dropped[bad]["reason"].startswith("malformed frame")
            assert svc.counter.messages(bad, ["malformed"]) == 1  # its bytes were counted too
            server.stop()

    trio.run(main)
    assert results["a"].record["rounds"] == [1, 2]


def test_restarted_server_resumes_from_saved_state(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    configure(homes[0], "pfesta-server", clients=1, rounds=3, steps_per_round=2)
    net = MemoryNetwork(seed=15)
    results: dict = {}
    seen: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as outer:
            first = daemon_on(net, homes[0])
            stopped = trio.Event()

            async def after_round(r: int) -> None:
                if r == 1:  # crash right after round 1 was saved, before round 2 opens
                    seen["version"] = first.services[0].campaign.server.version
                    first.stop()
                    await trio.sleep_forever()

            first.services[0].round_observers.append(after_round)

            async def run_first():
                await first.run([], [])
                stopped.set()

            outer.start_soon(run_first)

            async def go():
                results["a"] = await client(net, homes[1], first, "ink", data(1, limit=80), reconnect_timeout=30.0)

            # the server signs its service entry only once a member confirmed its chain head:
            # the client's connection does that
            outer.start_soon(go)
            await wait_for(lambda: first.services[0].ready.is_set(), "first server ready")
            await stopped.wait()
            second = daemon_on(net, homes[0])
            await outer.start(second.run, [], [])
            svc = second.services[0]
            await wait_for(lambda: "a" in results, "the client to finish after the restart", timeout=60)
            seen["loaded"] = svc.campaign.resumed
            seen["completed"] = svc.board.completed
            seen["final_version"] = svc.campaign.server.version
            second.stop()

    trio.run(main)
    rec = results["a"].record
    cid = rec["client"]
    assert seen["loaded"] == {cid} and seen["completed"] == 3
    assert seen["final_version"] == seen["version"] + 2 * 2  # rounds 2, 3 continued the saved body
    assert rec["reconnects"] >= 1 and rec["rounds"] == [1, 2, 3]
    c = ByteCounter.from_dict(rec["counter"])
    assert c.total(cid, "up", ["upload"], payload=True) == 80 * TOKENS[0] * TOKENS[1] * 4  # not re-uploaded


def test_msd_round_publishes_weights_clients_fine_tune(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 3)
    configure(homes[0], "msd-server", msd={"steps": 15, "batch_size": 64})
    net = MemoryNetwork(seed=16)
    results: dict = {}

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])

            async def go(name, home, task, spec):
                results[name] = await client(net, home, server, task, spec, finetune_steps=20)

            async with trio.open_nursery() as clients:
                clients.start_soon(go, "a", homes[1], "digit", data(1))
                clients.start_soon(go, "b", homes[2], "ink", data(2))
            server.stop()

    trio.run(main)
    led = Ledger.open(homes[0].ledger_db)
    try:
        (w,) = led.query(kind="weights")
    finally:
        led.close()
    ids = {results["a"].record["client"], results["b"].record["client"]}
    assert w.body["part"] == "body" and w.body["algorithm"] == "msd" and set(w.body["readers"]) == ids
    for res in results.values():
        rec = res.record
        assert rec["weights_entry"] == w.id.hex() and rec["weights_blob"] == w.body["blob"]
        row = check_record(res, "msd", tol=0.01)
        assert row["measured_down"] >= row["params"]["Pb"]
    assert "accuracy" in results["a"].metrics and "patch_accuracy" in results["b"].metrics
    # later, from the entry the client's ledger learned by sync and the blob it stored, with
    # the campaign's fine-tuning budget (20 steps): the same body, steps and seed give the
    # campaign's own result, and it learned the digits: above the majority rate, which a
    # constant predictor scores (0.16). Measured 0.21-0.46 over 16 runs under load: the body's
    # quality depends on how the two clients' batches interleave at the server in 15 steps;
    # 10 fine-tuning steps scored 0.075.
    out = finetune_from_entry(homes[1], task="digit", data=data(1), steps=20)
    assert out["entry"] == w.id.hex()
    acc, majority = out["metrics"]["accuracy"], majority_rate(data(1))
    assert acc == pytest.approx(results["a"].metrics["accuracy"], abs=1e-6), (out["metrics"], results["a"].metrics)
    assert acc > majority + 0.02, (acc, majority)


def test_join_errors_are_clear(tmp_path: Path) -> None:
    homes = make_consortium(tmp_path, 2)
    configure(homes[0], "pfesta-server", clients=1, max_samples=100)
    outsider = tmp_path / "outsider"
    from tests.factories import cli

    led = Ledger.open(homes[0].ledger_db)
    genesis = led.query(kind="genesis")[0].id.hex()
    led.close()
    cli("init", "--home", str(outsider), "--join", genesis)
    net = MemoryNetwork(seed=17)
    server_id = NodeIdentity.load(homes[0]).peer_id
    with pytest.raises(SplitJoinError, match="no address known"):
        trio.run(lambda: client_no_addr(net, homes[1], server_id))

    async def main() -> None:
        server = daemon_on(net, homes[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, [], [])
            with pytest.raises(SplitJoinError, match="not offered"):
                await client(net, homes[1], server, "nosuchtask", data(1))
            with pytest.raises(SplitJoinError, match="not a member"):
                await client(net, NodeHome.at(outsider), server, "digit", data(1, limit=50), sync=False)
            with pytest.raises(SplitJoinError, match="120 samples exceed"):  # refused by the server
                await client(net, homes[1], server, "digit", data(1))
            assert not server.services[0].board.members  # nobody was admitted
            server.stop()

    trio.run(main)


async def client_no_addr(net, home, server_id):
    t = MemoryTransport(net, NodeIdentity.load(home).signer.seed)
    try:
        async with t.run([]):
            await run_join(home, t, JoinOptions(server=server_id, task="digit", data=data(1)))
    except BaseExceptionGroup as eg:
        raise single_error(eg) from None


def test_report_rows_render_and_bad_records(tmp_path: Path) -> None:
    from atdnode.split import SplitReportError, render_report as render
    from atdnode.split.report import make_record, write_record
    from protocols.comm_cost import CostParams, t_pfesta

    home = NodeHome.at(tmp_path)
    p = CostParams(D=10, B=4, R=2, n=1, F=100, G=100, Ph=50, Pb=500, Pt=20)
    counter = ByteCounter()
    counter.record("c1", "up", "upload", wire_bytes=1000, payload_bytes=1000)
    counter.record("c1", "down", "body_out", wire_bytes=800, payload_bytes=800)
    counter.record("c1", "up", "grad_out", wire_bytes=800, payload_bytes=800)
    counter.record("c1", "up", "state_up", wire_bytes=40, payload_bytes=40)
    counter.record("c1", "down", "state_down", wire_bytes=40, payload_bytes=40)
    counter.record("c1", "up", "join", wire_bytes=30, payload_bytes=0)
    counter.record("c2", "up", "upload", wire_bytes=5, payload_bytes=5)  # another client's row: not kept
    rec = make_record(side="client", algorithm="pfesta", client="c1", server="s" * 52, task={"name": "digit"},
                      params=p, counter=counter.to_dict(), train_kinds=["upload", "body_out", "grad_out",
                                                                          "state_up", "state_down"], rounds=[1, 2])
    write_record(home, rec)
    (row,) = [report_row(r) for r in load_records(home)]
    assert row["measured"] == 2680 == t_pfesta(p) and row["rel_error"] == 0.0 and row["other_bytes"] == 30
    assert row["T_FESTA"] > row["T_pFESTA"]
    assert "T_pFESTA" in render([row]) and "pfesta" in render([row])
    (tmp_path / "split" / "records" / "zz-bad.json").write_text('{"version": 1}')
    with pytest.raises(SplitReportError, match="zz-bad.json"):
        load_records(home)


def test_settings_validate_and_round_trip(tmp_path: Path) -> None:
    s = SplitSettings.from_dict({**BASE, "msd": {"steps": 3}})
    assert SplitSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert s.total_rounds("festa") == 2 and s.total_rounds("msd") == 1
    assert parse_task("ink:segmentation::0.5") == {"name": "ink", "kind": "segmentation", "num_outputs": 1,
                                                   "loss_weight": 0.5}
    for bad, match in (({"rounds": -1}, "rounds"), ({"tasks": []}, "at least one task"),
                       ({"body": {"img_size": 15}}, "multiple"), ({"bogus": 1}, "unknown split setting"),
                       ({"msd": {"student_keep": 2.0}}, "msd"), ({"round_timeout": 0.0}, "round_timeout"),
                       ({"accept": "anyone"}, "split.accept")):
        with pytest.raises(SplitConfigError, match=match):
            SplitSettings.from_dict({**BASE, **bad})
    for bad in ("ink", "x:blob", "a:classification:ten"):
        with pytest.raises(SplitConfigError):
            parse_task(bad)


# ---------------------------------------------------------------------------- processes

def _cli(*args: str) -> str:
    from tests.factories import cli

    return cli(*args)


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A p-FESTA server and two clients with two tasks run as three OS processes on loopback.
    For the comparison the same two clients also join a FESTA server with the same setting,
    over real libp2p too, inside this test's process (three more interpreters would only add
    start-up time). The two `atd split join` processes are forked from one interpreter that
    imported torch once (tests/atd_forkserver.py). Returns the homes (p-FESTA server, clients),
    the jobs and the clients' JSON outputs; run once for the tests below."""
    root = tmp_path_factory.mktemp("acceptance")
    with forkserver(root, _env()) as warm:
        return _acceptance_run(root, warm)


def _acceptance_run(root: Path, warm: list[str]) -> dict:
    homes = make_consortium(root, 4)
    ps, fs, c1, c2 = (Path(h.root) for h in homes)
    setting = ["--task", "digit:classification:10", "--task", "ink:segmentation::0.5", "--rounds", "3",
               "--steps", "4", "--unify-every", "1", "--batch-size", "16", "--clients", "2",
               "--start-timeout", "120", "--round-timeout", "120"]
    _cli("split", "configure", "--home", str(ps), *setting)
    _cli("split", "configure", "--home", str(fs), *setting, "--json")
    jobs = ((c1, "digit", data(1, limit=150)), (c2, "ink", data(2, limit=150)))
    server = start_daemon(ps, "--role", "pfesta-server")
    procs: list[subprocess.Popen] = []
    try:
        peer = NodeIdentity.load(NodeHome.at(ps)).peer_id
        for c, task, spec in jobs:
            procs.append(subprocess.Popen(
                [*warm, "split", "join", "--home", str(c), "--server", peer, "--server-addr", server.addrs[0],
                 "--task", task, "--data", spec, "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()))
        festa_out = trio.run(_festa_over_libp2p, NodeHome.at(fs), [(NodeHome.at(c), t, d) for c, t, d in jobs],
                             server.addrs[0])
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()
    return {"ps": NodeHome.at(ps), "c1": NodeHome.at(c1), "c2": NodeHome.at(c2), "jobs": jobs,
            "outs": outs + festa_out}


@pytest.mark.slow
def test_acceptance_three_processes_pfesta_and_festa_report(acceptance: dict) -> None:
    """The processes' campaigns (`acceptance`) learned; `atd split report` shows measured vs
    formula bytes for both algorithms, and the p-FESTA embedder was a secret the server never
    held: no file of its home holds it, and what it stored are permuted embeddings
    (`_check_embedder_secret`)."""
    from tests.nodeprocs import atd

    jobs, c1, c2 = acceptance["jobs"], Path(acceptance["c1"].root), Path(acceptance["c2"].root)
    metrics = {(o["algorithm"], o["task"]["name"]): o["metrics"] for o in acceptance["outs"]}
    assert set(metrics) == {("pfesta", "digit"), ("pfesta", "ink"), ("festa", "digit"), ("festa", "ink")}
    digit_majority = majority_rate(jobs[0][2])  # 0.147 on this shard's held-out split
    for algo in ("pfesta", "festa"):
        ink = metrics[(algo, "ink")]  # the positive patch rate is ~0.52: compare with the majority rate
        # 12 steps; the in-memory test_pfesta_two_tasks_over_the_network holds a 0.05 margin after 6
        assert ink["patch_accuracy"] > ink["patch_majority"] + 0.05, (algo, ink)
        # 12 steps reach 0.38-0.47 here (measured): well clear of a constant predictor
        assert metrics[(algo, "digit")]["accuracy"] > 1.5 * digit_majority, (algo, metrics)
    rows = json.loads(atd("split", "report", "--home", str(c1), "--home", str(c2), "--json").stdout)
    assert len(rows) == 4
    for row in rows:
        assert abs(row["rel_error"]) < 0.05, row
    for client_home in (c1, c2):
        mine = {r["algorithm"]: r for r in rows if r["record"].startswith(str(client_home))}
        assert mine["pfesta"]["measured"] < mine["festa"]["measured"]
        same = ("D", "B", "R", "n", "F", "G")  # the same setting for both algorithms
        assert {k: mine["pfesta"]["params"][k] for k in same} == {k: mine["festa"]["params"][k] for k in same}
    table = _cli("split", "report", "--home", str(c1))
    assert "T_pFESTA" in table and "pfesta" in table and "festa" in table
    _check_embedder_secret(acceptance["ps"], acceptance["c1"], acceptance["c2"], jobs[0][2])


def _check_embedder_secret(ps: NodeHome, c1: NodeHome, c2: NodeHome, spec: str) -> None:
    """The p-FESTA embedder is the clients' secret. Both clients used the one the
    server adopted; no file of the server's home (ledger, WAL, state, records, its log)
    holds its bytes or any seed field; what the server stored for client 1 is, image by
    image, its in-order embeddings (made here with the client's secret, as an oracle) with
    the positions shuffled: the input test_reconstruction's attackers fail on
    (test_every_attacker_needs_the_order; the attacker on these very uploads:
    test_the_papers_attacker_needs_the_order_the_server_never_saw, `--claims`)."""
    from tests.split_checks import campaign_secret, files_containing, in_order_and_stored, secret_bytes

    cfg = SplitSettings.load(ps).vit_config()
    state = campaign_secret(c1, cfg)
    assert all(torch.equal(state[k], v) for k, v in campaign_secret(c2, cfg).items())
    assert files_containing(Path(ps.root), secret_bytes(state) + [b"embedder_seed"]) == []
    in_order, stored, _ = in_order_and_stored(ps, c1, spec, cfg)
    assert stored.shape == in_order.shape
    same_rows = (stored.unsqueeze(2) - in_order.unsqueeze(1)).abs().amax(-1) < 1e-5  # (M, N stored, N in order)
    assert bool((same_rows.sum(-1) >= 1).all())  # every stored token is one of its own image's tokens
    assert bool((same_rows.sum(-2) >= 1).all())  # and every token of the image was stored
    moved = (stored - in_order).abs().amax(-1) > 1e-5  # (M, N): a position holding another token
    assert moved.float().mean() > 0.5, moved.float().mean()  # a uniform shuffle moves ~(N-1)/N of them


@pytest.mark.slow
@pytest.mark.claims
def test_the_papers_attacker_needs_the_order_the_server_never_saw(acceptance: dict) -> None:
    """The paper's attacker, trained on public digits disjoint from client 1's, reconstructs
    clearly worse from what the server stored (permuted) than from the same images' in-order
    embeddings. A claims-tier test (~20 s of CPU idle, ~60 s under load): the default suite
    checks the same with cheaper inputs (test_reconstruction.test_every_attacker_needs_the_order
    on permuted uploads, `_check_embedder_secret` that the server's uploads are permuted)."""
    from protocols.inversion_attack import AttackConfig
    from tests.split_checks import attack_margin

    cfg = SplitSettings.load(acceptance["ps"]).vit_config()
    # test_reconstruction's budget (its margins are wide; the default costs ~2x the CPU): measured
    # here plain mse 0.008 / ssim 0.90 (baseline 0.043 / 0.40), permuted 0.061 / 0.37
    ac = AttackConfig(steps=400, hidden=128, jigsaw_steps=200)
    plain, perm = attack_margin(acceptance["ps"], acceptance["c1"], acceptance["jobs"][0][2],
                                [("digits?shard=2/2", "train"), ("digits", "test")], cfg, ac)
    print("paper's attacker without permutation", plain, "with permutation (server's uploads)", perm)
    assert plain["mse"] < 0.6 * plain["baseline_mse"] and plain["ssim"] > plain["baseline_ssim"] + 0.2
    assert perm["mse"] > 2 * plain["mse"] and perm["ssim"] < plain["ssim"] - 0.25


async def _festa_over_libp2p(fs: NodeHome, jobs, bootstrap: str) -> list[dict]:
    """A FESTA server daemon and two clients on real libp2p transports, in this process."""
    from atdnode.node import NodeDaemon
    from atdnode.transport import Libp2pTransport

    cfg = NodeConfig.load(fs)
    cfg.role = "festa-server"  # what `atd node start --role festa-server` stores
    cfg.save(fs)
    daemon = NodeDaemon(fs, sync_interval=1.0, poll_interval=0.1)
    out: list[dict] = []
    async with trio.open_nursery() as nursery:
        addrs = await nursery.start(daemon.run, ["/ip4/127.0.0.1/tcp/0"], [bootstrap])
        # it learns the membership (and its offer enters its log) from the founder
        await wait_for(lambda: _service_in_log(Path(fs.root)), "the FESTA offer in the log", timeout=90)

        async def one(home: NodeHome, task: str, spec: str) -> None:
            t = Libp2pTransport(NodeIdentity.load(home).libp2p_keypair())
            async with t.run(["/ip4/127.0.0.1/tcp/0"]):
                res = await run_join(home, t, JoinOptions(server=daemon.transport.peer_id, task=task, data=spec,
                                                          server_addrs=addrs))
                out.append(res.record)

        async with trio.open_nursery() as clients:
            for home, task, spec in jobs:
                clients.start_soon(one, home, task, spec)
        daemon.stop()
    return out


def _service_in_log(home: Path) -> bool:
    led = Ledger.open(home / "ledger.db")
    try:
        return bool(led.query(kind="service", author=NodeIdentity.load(NodeHome.at(home)).public_key))
    finally:
        led.close()
