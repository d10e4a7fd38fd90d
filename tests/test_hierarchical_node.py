"""Hierarchical (ATD-in-ATD) on node homes: a later group joins without rebuilding the first."""
from __future__ import annotations

import hashlib
import math

import pytest
from typer.testing import CliRunner

from atdnode.aggregation import AggregateError
from atdnode.blobs import BlobStore
from atdnode.node import NodeIdentity
from atdnode.models import ModelRegistry
from cli.app import app
from ledger import Ledger
from tests.factories import cli_json as cli
from tests.vgs_homes import ENSEMBLE_ARGS, copy_homes, sync

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


@pytest.fixture
def trio(vgs_template, tmp_path):
    template = vgs_template("disjoint")
    return copy_homes(template, tmp_path / "homes")


def hier(home, *groups: str, weighting: str | None = None) -> dict:
    args = ["aggregate", "--home", str(home.root), "--mode", "hierarchical", *ENSEMBLE_ARGS]
    for g in groups:
        args += ["--group", g]
    if weighting:
        args += ["--weighting", weighting]
    return cli(*args)


def weights_by_node(trio) -> list[str]:
    """The weights entries of a, b and c (each published its extractor once)."""
    with Ledger.open(trio[0].ledger_db) as led:
        return [led.query(kind="weights", author=NodeIdentity.load(h).public_key)[0].id.hex() for h in trio]


def fingerprint(home, blob: str) -> tuple[int, str]:
    p = BlobStore(home.blobs_dir).path(blob)
    return p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()


def test_late_group_reuses_the_first_group_model(trio):
    a, b, c = trio
    wa, wb, wc = weights_by_node(trio)
    first = hier(a, f"g1={wa},{wb}")
    g1 = first["groups"][0]
    assert not g1["reused"] and g1["n_classes"] == 6 and g1["n_models"] == 2 and first["weights"] == [1.0]
    assert first["classes"] == ["0", "1", "2"]  # the ensemble on a's own features
    before = fingerprint(a, g1["blob"])
    runs = sorted(p.name for p in a.runs_dir.iterdir())
    trained = [r.id for r in ModelRegistry(a).list() if r.provenance.get("run_key")]

    later = hier(a, f"g1={wa},{wb}", f"g2={wc}", weighting="model-count")
    r1, r2 = later["groups"]
    assert r1 == {**g1, "reused": True} and not r2["reused"] and (r2["n_classes"], r2["n_models"]) == (4, 1)
    assert later["weights"] == pytest.approx([2 / 3, 1 / 3], abs=1e-15)
    sq = hier(a, f"g1={wa},{wb}", f"g2={wc}", weighting="sqrt-classes")
    s6, s4 = math.sqrt(6), math.sqrt(4)
    assert sq["weights"] == pytest.approx([s6 / (s6 + s4), s4 / (s6 + s4)], abs=1e-15)
    assert all(g["reused"] for g in sq["groups"]) and sq["blob"] != later["blob"]
    # the first group: same entry, same bytes, untouched file; nothing retrained
    assert fingerprint(a, g1["blob"]) == before
    with Ledger.open(a.ledger_db) as led:
        groups = [e.body["name"] for e in led.query(kind="aggregate") if e.body["mode"] == "group"]
    assert sorted(groups) == ["g1", "g2"]
    assert sorted(p.name for p in a.runs_dir.iterdir()) == runs
    assert [r.id for r in ModelRegistry(a).list() if r.provenance.get("run_key")] == trained

    # another node reuses a's stored group models by their entries and gets the same combination
    sync(trio)
    on_b = hier(b, f"g1={r1['entry']}", f"g2={r2['entry']}", weighting="model-count")
    assert on_b["blob"] == later["blob"] and all(g["reused"] for g in on_b["groups"])
    assert on_b["classes"] == ["3", "4", "5"]
    assert cli("aggregate", "--home", str(c.root), "--verify", later["entry"])["verified"]


def test_verify_catches_forged_group_sizes_and_weights(trio):
    a, b, c = trio
    wa, wb, wc = weights_by_node(trio)
    res = hier(a, f"g1={wa},{wb}", f"g2={wc}", weighting="model-count")
    ident = NodeIdentity.load(a)
    with Ledger.open(a.ledger_db) as led:
        body = dict(led.get(res["entry"]).body)
        bigger = [dict(g) for g in body["groups"]]
        bigger[1]["n_models"] = 2  # claims g2 had two members, which would make the weights 1/2, 1/2
        forged_sizes = led.append(ident.signer, "aggregate", {**body, "groups": bigger, "weights": [0.5, 0.5]})
        forged_weights = led.append(ident.signer, "aggregate", {**body, "weights": [0.6, 0.4]})
    sync(trio)
    for forged, why in ((forged_sizes, "has 4 classes and 1 models"),
                        (forged_weights, "recorded weights")):
        r = runner.invoke(app, ["aggregate", "--home", str(c.root), "--verify", forged.id.hex()])
        assert isinstance(r.exception, AggregateError) and why in str(r.exception), r.exception


def test_group_option_errors(trio):
    a = trio[0]
    wa, wb, wc = weights_by_node(trio)
    base = ["aggregate", "--home", str(a.root), "--mode", "hierarchical"]
    for args, why in (([], "at least one --group"),
                      (["--group", "g1"], "NAME=ENTRY_ID"),
                      (["--group", f"g1={wa}", "--group", f"g1={wb}"], "distinct"),
                      (["--group", f"g1={wa}", "--weighting", "uniform"], "sqrt-classes, model-count"),
                      (["--group", f"g1={wa},{'0' * 64}"], "not in this node's ledger")):
        r = runner.invoke(app, base + args)
        assert isinstance(r.exception, AggregateError) and why in str(r.exception), (args, r.exception)
    r = runner.invoke(app, base + ["--inputs", wa])
    assert r.exit_code != 0 and "--group" in str(r.exception)
    r = runner.invoke(app, base + ["--group", f"g1={wa}", "--group-weighting", "model-count"])  # not a group weighting
    assert r.exit_code == 2 and "--group-weighting" in r.output and "'model-count' is not one of" in r.output, r.output


def test_groups_from_different_bases_warn_and_strict_refuses(trio):
    """Combining groups trained from unrelated random starts gives a random body;
    `atd aggregate --mode hierarchical` warns, and `--strict` refuses before recording."""
    from atdnode.models import publish_weights
    from tests.vgs_homes import DISJOINT, train_node

    a, b, c = trio
    wa, wb, wc = weights_by_node(trio)
    shared = hier(a, f"g1={wa},{wb}", f"g2={wc}")  # c started from a's extractor: one base
    assert "warnings" not in shared
    train_node(c, DISJOINT["c"], epochs=1, seed=7)  # c again, from its own random start
    other = publish_weights(c, part="extractor").entry.id.hex()
    sync(trio)
    with Ledger.open(a.ledger_db) as led:
        before = len(led.query(kind="aggregate"))
    mixed = hier(a, f"g1={wa},{wb}", f"g3={other}")
    assert any("do not descend from one shared base" in w for w in mixed["warnings"]), mixed
    args = ["aggregate", "--home", str(a.root), "--mode", "hierarchical", *ENSEMBLE_ARGS, "--strict",
            "--group", f"g1={wa},{wb}", "--group", f"g4={other}"]
    r = runner.invoke(app, args)
    assert isinstance(r.exception, AggregateError) and "--strict" in str(r.exception), r.output
    with Ledger.open(a.ledger_db) as led:  # the refused run recorded nothing (the warned one did: 2 entries)
        assert len(led.query(kind="aggregate")) == before + 2
    ok = runner.invoke(app, args[:-4] + ["--group", f"g1={wa},{wb}", "--group", f"g2={wc}"])
    assert ok.exit_code == 0, ok.output  # --strict passes groups of one base
