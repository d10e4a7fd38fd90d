"""Default `atd aggregate` (no --inputs) skips weight sets it cannot use and says why.

One member publishing a bad weight set (NaN tensors, here) used to make every default
aggregation abort; now the aggregate entry names the skipped input and the reason.
"""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from atdnode.blobs import BlobStore
from atdnode.node import NodeIdentity
from atdnode.models import load_weights, save_weights
from cli.app import app
from ledger import Ledger
from tests.vgs_homes import ENSEMBLE_ARGS, copy_homes

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


def test_default_aggregation_skips_a_nan_weight_set(vgs_template, tmp_path):
    homes = copy_homes(vgs_template("skewed"), tmp_path / "homes")
    a = homes[0]
    store = BlobStore(a.blobs_dir)
    with Ledger.open(a.ledger_db) as led:
        good = led.query(kind="weights")[-1]
        tensors, meta = load_weights(store, good.body["blob"])
        name = sorted(tensors)[0]
        tensors[name] = torch.full_like(tensors[name], float("nan"))
        bad_blob = save_weights(store, tensors, meta)
        body = {**good.body, "blob": bad_blob, "size": store.size(bad_blob), "manifest": store.manifest(bad_blob).hash}
        bad = led.append(NodeIdentity.load(a).signer, "weights", body)
    r = runner.invoke(app, ["aggregate", "--home", str(a.root), "--mode", "horizontal", *ENSEMBLE_ARGS,
                                "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert bad.id.hex() not in out["inputs"] and len(out["inputs"]) >= 2
    why = {s["entry"]: s["why"] for s in out["skipped_inputs"]}
    assert "non-finite" in why[bad.id.hex()]
    with Ledger.open(a.ledger_db) as led:
        entry = led.get(out["entry"])
    assert {s["entry"] for s in entry.body["skipped"]} >= {bad.id.hex()}  # the signed entry says so too
    r = runner.invoke(app, ["aggregate", "--home", str(a.root), "--mode", "horizontal", "--inputs", bad.id.hex()])
    assert r.exit_code != 0  # named explicitly, it is still an error
