"""Serverless rounds (atdnode.rounds.runner): determinism, deadline with a missing peer, rejoin,
verification, FedWAvg ~ 1/K on IID data. In-process homes synced like daemons would
(tests.vgs_homes.sync); the OS-process run is tests/test_rounds_procs.py. The runner, not
only the CLI, keeps a node's models under `[models] max_bytes`."""
from __future__ import annotations

import pytest
import trio as trio_lib

from atdnode.aggregation import AggregateError, verify_entry
from atdnode.blobs import BlobStore
from atdnode.node import NodeConfig, NodeIdentity
from atdnode.models import ModelRecord, ModelRegistry, load_weights
from atdnode.rounds import current_round
from atdnode.rounds import round_weights_entries
from atdnode.rounds.rules import compute_round, round_aggregate
from atdnode.rounds import RoundRunner, RoundsConfig
from ledger import Ledger
from tests.vgs_homes import cfg, consortium, peer_ids, sync

SPEC = "digits?shard={i}/{n}&limit=240"


def runner(home, i, n, **kw) -> RoundRunner:
    conf = RoundsConfig(data=SPEC.format(i=i, n=n), cfg=cfg(), rounds=kw.pop("rounds", 2), lr=3e-3,
                        weighting=kw.pop("weighting", "fedwavg"), **kw)
    return RoundRunner(home, conf)


def train_publish(r: RoundRunner, rnd: int):
    return r.publish(rnd, r.train_round(rnd, trio_lib.run(r.global_blob, rnd)))


@pytest.fixture
def trio(tmp_path):
    return consortium(tmp_path, ["a", "b", "c"])


def test_two_nodes_compute_bit_identical_globals_and_verify(trio):
    a, b, _ = trio
    ra, rb = runner(a, 1, 3), runner(b, 2, 3)
    assert ra.init == rb.init and ra.campaign == rb.campaign  # one shared initial model
    train_publish(ra, 0), train_publish(rb, 0)
    # a round's local model keeps its metrics (confusion matrix included) and history.csv, but
    # draws no PNGs (TrainOptions.plots: two per node and round cost ~0.3 s of CPU, half a round)
    (rec,) = [r for r in ModelRegistry(a).list() if r.provenance.get("round") == 0]
    assert len(rec.metrics["confusion"]) == len(rec.labels) > 1 and set(rec.files) == {"history_csv"}
    assert not list((a.root / rec.files["history_csv"]).parent.glob("*.png"))
    sync(trio)
    with Ledger.open(a.ledger_db) as led:
        inputs = round_weights_entries(led, ra.campaign, 0)
    assert [e.id.hex() for e in inputs] == sorted(e.id.hex() for e in inputs) and len(inputs) == 2
    # each node computes independently over the same inputs
    wa, (ta, _) = compute_round(ra.store, inputs, weighting="fedwavg", q=1.0, reference=ra.init)
    wb, (tb, _) = compute_round(rb.store, inputs, weighting="fedwavg", q=1.0, reference=rb.init)
    assert wa == wb and all(bool((ta[k] == tb[k]).all()) for k in ta)
    entry = ra.record(0, inputs, peer_ids(trio), ra.init)
    assert entry.body["missing"] == [peer_ids(trio)[2]]
    sync(trio)
    blob = trio_lib.run(rb.adopt, round_aggregate(Ledger.open(b.ledger_db), rb.campaign, 0))
    assert blob == entry.body["blob"]
    assert load_weights(rb.store, blob)[0].keys() == ta.keys()
    # the existing verify path (atd aggregate --verify) checks it too, and rejects forged weights
    with Ledger.open(b.ledger_db) as led:
        assert verify_entry(led, rb.store, led.get(entry.id)) == blob
        forged = led.append(NodeIdentity.load(b).signer, "aggregate", {**entry.body, "weights": [0.9, 0.1]})
        with pytest.raises(AggregateError, match="does not verify"):
            verify_entry(led, BlobStore(b.blobs_dir), forged)
    assert current_round(Ledger.open(b.ledger_db), rb.campaign) == 1


def plant_unserved_model(home) -> tuple[str, str]:
    """An old model no entry names (so removable), and `[models] max_bytes = 1` on `home`."""
    store = BlobStore(home.blobs_dir)
    blob = store.put_bytes(b"an old model's weights")
    rec = ModelRecord(model={}, labels=[], label_fp="", samples=0, metrics={}, blobs={"full": blob}, created=0.0)
    model_id = ModelRegistry(home).add(rec)
    conf = NodeConfig.load(home)
    conf.extra["models"] = {"max_bytes": 1}
    conf.save(home)
    return model_id, blob


def test_deadline_leaves_out_and_names_a_missing_peer_then_it_rejoins(trio, caplog):
    a, b, c = trio
    ra, rb = runner(a, 1, 3, deadline=1.0), runner(b, 2, 3, deadline=1.0)
    train_publish(rb, 0)
    sync(trio)
    rep = trio_lib.run(ra.run_round, 0)  # c never publishes: a waits 1 s (deadline), then records or adopts
    assert rep.missing == [peer_ids(trio)[2]] and len(rep.inputs) == 2
    sync(trio)
    # c was down; restarted, it derives its round from the ledger and holds the same global model
    rc = runner(c, 3, 3, deadline=1.0)
    with Ledger.open(c.ledger_db) as led:
        assert current_round(led, rc.campaign) == 1
    assert trio_lib.run(rc.global_blob, 1) == rep.blob
    # round 1: b and c publish (c from the shared global), a is the late one this time
    train_publish(rb, 1), train_publish(rc, 1)
    sync(trio)
    old, blob = plant_unserved_model(c)  # and c keeps at most 1 byte of models: the runner's registrations apply it
    with caplog.at_level("WARNING", logger="atd.models"):
        rep1 = trio_lib.run(rc.run_round, 1)
    assert rep1.missing == [peer_ids(trio)[0]]
    assert old not in [r.id for r in ModelRegistry(c).list()] and not rc.store.has(blob)
    assert rep1.metrics["model"] in [r.id for r in ModelRegistry(c).list()]  # the newest and served ones stay
    assert any(f"removed old model {old}" in m for m in caplog.messages)
    sync(trio)
    assert trio_lib.run(ra.global_blob, 2) == rep1.blob == trio_lib.run(rb.global_blob, 2)


def test_fedwavg_weights_near_uniform_on_iid_data(tmp_path):
    homes = consortium(tmp_path, ["a", "b", "c", "d"])
    rs = [runner(h, i + 1, 4) for i, h in enumerate(homes)]
    for r in rs:
        train_publish(r, 0)
    sync(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        inputs = round_weights_entries(led, rs[0].campaign, 0)
    w, _ = compute_round(rs[0].store, inputs, weighting="fedwavg", q=1.0, reference=rs[0].init)
    assert len(w) == 4 and max(abs(x - 0.25) for x in w) < 0.05, w
    # q sharpens: with a large scale the weights move away from uniform (the test can fail)
    w_sharp, _ = compute_round(rs[0].store, inputs, weighting="fedwavg", q=200.0, reference=rs[0].init)
    assert max(abs(x - 0.25) for x in w_sharp) > max(abs(x - 0.25) for x in w)


@pytest.mark.slow  # atd processes
def test_bad_weighting_or_aggregator_is_a_one_line_error(tmp_path):
    import subprocess
    import sys

    (a,) = consortium(tmp_path, ["a"])
    cases = {("--weighting", "median"): "error: Invalid value for '--weighting': 'median' is not one of 'fedavg', "
                                        "'fedwavg'. Try 'atd rounds --help'.",
             ("--aggregator", "mode"): "error: Invalid value for '--aggregator': 'mode' is not one of 'fedavg', "
                                       "'fedwavg', 'median', 'trimmed-mean', 'krum', 'multi-krum'. Try 'atd rounds --help'."}
    for args, line in cases.items():
        proc = subprocess.run([sys.executable, "-m", "cli.app", "rounds", "--home", str(a.root), "--rounds", "1", *args],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [line]
