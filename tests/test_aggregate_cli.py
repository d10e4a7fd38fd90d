"""`atd aggregate` horizontal acceptance, `--verify` against tampering (horizontal and
vertical), and the command's errors."""
from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from atdnode.aggregation import AggregateError, average_blobs, result_meta
from atdnode.blobs import BlobStore
from atdnode.node import NodeIdentity
from atdnode.models import save_weights
from cli.app import app, main
from ledger import Ledger
from tests.factories import cli_json as cli
from tests.vgs_homes import ENSEMBLE_ARGS, copy_homes, latest, sync

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


def fails(*args: str) -> Exception:
    r = runner.invoke(app, list(args))
    assert r.exit_code != 0 and r.exception is not None, r.output
    return r.exception


@pytest.fixture
def skewed(vgs_template, tmp_path):
    template = vgs_template("skewed")
    return copy_homes(template, tmp_path / "homes")


@pytest.fixture
def disjoint(vgs_template, tmp_path):
    template = vgs_template("disjoint")
    return copy_homes(template, tmp_path / "homes")


def fine_tuned(home) -> list[str]:
    """The three fine-tuned full sets (the first weights entry is a's shared base)."""
    with Ledger.open(home.ledger_db) as led:
        return [e.id.hex() for e in led.query(kind="weights")][1:]


@pytest.mark.slow  # three aggregations (one fits the ensemble), five scorings of the digits test split
def test_horizontal_on_skewed_nodes_beats_every_single_node(skewed):
    single = {h.root.name: cli("classify", "--home", str(h.root), "--data", "digits", "--model", latest(h).id)["accuracy"]
              for h in skewed}
    inputs = fine_tuned(skewed[0])
    out = cli("aggregate", "--home", str(skewed[0].root), "--mode", "horizontal", "--classifier", "head",
              "--inputs", ",".join(inputs))
    assert set(out) >= {"entry", "blob", "weights", "inputs", "model"} and out["inputs"] == inputs
    assert out["head"] is True and out["weights"] == [1 / 3] * 3
    glob = cli("classify", "--home", str(skewed[0].root), "--data", "digits", "--model", out["model"])
    assert glob["model"] == out["model"] and glob["kind"] == "model"  # the global model (keep = best may not use it)
    print(f"horizontal: single nodes {single}, global {glob['accuracy']:.4f}")
    assert glob["accuracy"] >= max(single.values()), (single, glob["accuracy"])  # measured 0.546 vs 0.507
    # the paper's default: the fused extractor's CLS features -> PCA -> MLP + RF + SVM ensemble
    ens = cli("aggregate", "--home", str(skewed[0].root), "--mode", "horizontal", "--inputs", ",".join(inputs),
              *ENSEMBLE_ARGS)
    assert ens["blob"] == out["blob"] and "ensemble" in ens
    glob_ens = cli("classify", "--home", str(skewed[0].root), "--data", "digits", "--model", ens["model"])
    assert glob_ens["model"] == ens["model"] and glob_ens["kind"] == "ensemble"  # (keep = best may not use it)
    print(f"horizontal + ensemble: {glob_ens['accuracy']:.4f}")
    assert glob_ens["accuracy"] >= max(single.values()), (single, glob_ens["accuracy"])
    # samples weighting: proportional to the recorded sample counts
    with Ledger.open(skewed[0].ledger_db) as led:
        counts = [led.get(i).body["samples"] for i in inputs]
    by_samples = cli("aggregate", "--home", str(skewed[0].root), "--weighting", "samples", "--classifier", "head",
                     "--inputs", *inputs[:1],
                     "--inputs", ",".join(inputs[1:]))
    assert by_samples["weights"] == pytest.approx([n / sum(counts) for n in counts], abs=1e-15)
    sync(skewed)
    for entry in (out["entry"], by_samples["entry"]):
        assert cli("aggregate", "--home", str(skewed[2].root), "--verify", entry)["verified"]


def _forge(home, entry_id: str, **changes) -> str:
    """Node `home` signs a copy of aggregate `entry_id` with `changes` in its body."""
    ident = NodeIdentity.load(home)
    with Ledger.open(home.ledger_db) as led:
        body = {**led.get(entry_id).body, **changes}
        return led.append(ident.signer, "aggregate", body).id.hex()


@pytest.mark.parametrize("mode", ["horizontal", "vertical"])
def test_verify_catches_results_that_do_not_match_their_inputs(disjoint, mode):
    a, b, c = disjoint
    extra = ENSEMBLE_ARGS if mode == "vertical" else ["--classifier", "head"]
    out = cli("aggregate", "--home", str(a.root), "--mode", mode, *extra)
    assert len(out["inputs"]) == 3 and out["head"] is False  # three extractors
    store = BlobStore(a.blobs_dir)
    with Ledger.open(a.ledger_db) as led:
        blobs = [led.get(i).body["blob"] for i in out["inputs"]]
    # 1) weights that are not the weighting's: the result matches them, the rule does not
    skew = [0.5, 0.25, 0.25]
    tensors = average_blobs(store, blobs, skew, names=["x", "y", "z"], head=False)
    other = save_weights(store, tensors, result_meta(store, blobs[0], part="extractor", mode=mode, weighting="uniform"))
    forged_weights = _forge(a, out["entry"], weights=skew, blob=other)
    # 2) the right weights, a result blob that is not their average
    forged_blob = _forge(a, out["entry"], blob=blobs[0])
    # 3) a claim that heads were averaged
    forged_head = _forge(a, out["entry"], head=True)
    # 4) a body whose field has the wrong type (written past the typed writer): the reader names it
    forged_type = _forge(a, out["entry"], inputs=",".join(out["inputs"]))
    sync(disjoint)
    for entry, why in ((forged_weights, "are not the uniform weights"), (forged_blob, "recomputed result"),
                       (forged_head, "heads"), (forged_type, "'inputs' must be list")):
        err = fails("aggregate", "--home", str(c.root), "--verify", entry)
        assert isinstance(err, AggregateError) and why in str(err), err
    assert cli("aggregate", "--home", str(c.root), "--verify", out["entry"])["verified"]
    # 4) an input blob damaged on disk is named, not averaged
    path = BlobStore(c.blobs_dir).path(blobs[1])
    path.chmod(0o644)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    err = fails("aggregate", "--home", str(c.root), "--verify", out["entry"])
    assert isinstance(err, AggregateError) and "entry" in str(err)


def test_aggregate_errors_are_one_line(disjoint, tmp_path, monkeypatch, capsys):
    a = disjoint[0]
    with Ledger.open(a.ledger_db) as led:
        hello = led.query(kind="hello")[0].id.hex()
        weights = led.query(kind="weights")[0].id.hex()
    for args, why in ((["--verify", "xyz"], "not a 64-hex-digit"),
                      (["--verify", "ab" * 32], "not in this node's ledger"),
                      (["--verify", weights], "is a weights entry"),
                      (["--inputs", hello], "is a hello entry"),
                      (["--weighting", "model-count"], "does not apply"),
                      (["--mode", "horizontal", "--group", f"g={weights}"], "--group applies"),
                      (["--classifier", "head", "--features", weights], "--features / --data"),
                      (["--mode", "vertical", "--classifier", "head"], "--mode horizontal only"),
                      (["--mode", "hierarchical", "--weighting", "uniform"], "does not apply to --mode hierarchical"),
                      (["--mode", "vertical", "--mlp-hidden", "64,x"], "--mlp-hidden")):
        err = fails("aggregate", "--home", str(a.root), *args)
        assert why in str(err), (args, err)
    # a node without any trained model
    from atdnode.node import NodeHome, init_home

    lone = NodeHome.at(tmp_path / "lone")
    init_home(lone, consortium="x")
    assert "no trained models" in str(fails("aggregate", "--home", str(lone.root)))
    monkeypatch.setattr(sys, "argv", ["atd", "aggregate", "--home", str(a.root), "--verify", "ab" * 32])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1 and err.startswith("error: aggregate entry")


def test_default_inputs_skip_what_does_not_fit(disjoint):
    a = disjoint[0]
    # horizontal by default takes every held extractor; a head-only publication is not a candidate
    # (the inputs are chosen before the classifier: `--classifier head` spares the ensemble's fit)
    from atdnode.models import publish_weights

    head = publish_weights(a, part="head")
    out = cli("aggregate", "--home", str(a.root), "--classifier", "head")
    assert head.entry.id.hex() not in out["inputs"] and len(out["inputs"]) == 3
    err = fails("aggregate", "--home", str(a.root), "--inputs", head.entry.id.hex())
    assert isinstance(err, AggregateError) and "head set" in str(err)


def test_fedwavg_does_not_depend_on_input_order(vgs_template, tmp_path):
    """FedWAvg compares every input with the node's own current model (the recorded
    reference), never with input 0: on two copies of one node, reordering the inputs
    reorders the weights and leaves the result unchanged (up to float32 summation order)."""
    import torch

    from atdnode.models import load_weights

    template = vgs_template("skewed")
    one, two = copy_homes(template, tmp_path / "one")[0], copy_homes(template, tmp_path / "two")[0]
    inputs = fine_tuned(one)
    own = latest(one).blobs["full"]
    fwd = cli("aggregate", "--home", str(one.root), "--weighting", "fedwavg", "--q", "50", "--classifier", "head",
              "--inputs", ",".join(inputs))
    rev = cli("aggregate", "--home", str(two.root), "--weighting", "fedwavg", "--q", "50", "--classifier", "head",
              "--inputs", ",".join(reversed(inputs)))
    assert rev["weights"] == pytest.approx(list(reversed(fwd["weights"])), abs=1e-12)
    assert max(fwd["weights"]) - min(fwd["weights"]) > 1e-3, fwd["weights"]  # not uniform here
    with Ledger.open(one.ledger_db) as led:
        assert led.get(fwd["entry"]).body["reference"] == own
    a, _ = load_weights(BlobStore(one.blobs_dir), fwd["blob"])
    b, _ = load_weights(BlobStore(two.blobs_dir), rev["blob"])
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert cli("aggregate", "--home", str(two.root), "--verify", rev["entry"])["verified"]


def test_averaging_models_from_different_random_starts_warns(tmp_path):
    """Every weights entry records the start it descends from (`base`); `atd aggregate`
    warns when its inputs have different ones (same seed and config = same start)."""
    from atdnode.models import publish_weights
    from tests.vgs_homes import consortium, train_node

    homes = consortium(tmp_path / "homes", ["x", "y", "z"])
    ids = []
    for h, seed in zip(homes, (0, 0, 5)):
        train_node(h, "digits?classes=0,1", epochs=1, seed=seed)
        ids.append(publish_weights(h, part="full").entry.id.hex())
    sync(homes)
    with Ledger.open(homes[0].ledger_db) as led:
        bases = [led.get(i).body["base"] for i in ids]
    assert bases[0] == bases[1] != bases[2] and bases[0].startswith("init:")
    same = runner.invoke(app, ["aggregate", "--home", str(homes[0].root), "--classifier", "head",
                               "--inputs", ",".join(ids[:2])])
    assert same.exit_code == 0 and "different starts" not in same.output, same.output
    mixed = runner.invoke(app, ["aggregate", "--home", str(homes[0].root), "--classifier", "head",
                                "--inputs", ",".join(ids)])
    assert mixed.exit_code == 0 and "warning: the 3 inputs descend from 2 different starts" in mixed.output
