"""Sealed feature sharing between node homes: recipients read, everyone else cannot."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from atdnode.blobs import BlobStore
from atdnode.aggregation import FeaturesError, recipient_keys, share_features
from atdnode.aggregation.features_share import extractor_blob, node_features, open_features
from atdnode.node import NodeIdentity
from atdnode.learning import ModelConfig
from cli.app import app, main
from ledger import Ledger, Signer
from tests.vgs_homes import ENSEMBLE_ARGS, copy_homes, latest, peer_ids, sync

runner = CliRunner()


@pytest.fixture
def trio(vgs_template, tmp_path):
    template = vgs_template("disjoint")
    return copy_homes(template, tmp_path / "homes")


def _open(home, entry_id: str):
    ident, store = NodeIdentity.load(home), BlobStore(home.blobs_dir)
    with Ledger.open(home.ledger_db) as led:
        return open_features(ident, store, led, led.get(entry_id))


def test_recipient_opens_exactly_what_was_sealed_and_the_ledger_says_who(trio):
    a, b, c = trio
    pa, pb, pc = peer_ids(trio)
    shared = share_features(a, to=[pb])
    sync(trio)
    opened = _open(b, shared.entry.id.hex())
    rec = latest(a)
    X, y, classes = node_features(a, BlobStore(a.blobs_dir), ModelConfig.from_dict(rec.model),
                                  extractor_blob(BlobStore(a.blobs_dir), rec), rec.provenance["data"])
    assert np.array_equal(opened.X, X) and np.array_equal(opened.y, y) and opened.classes == classes == ["0", "1", "2"]
    assert opened.sender == pa and opened.extractor == rec.blobs["extractor"]
    body = shared.entry.body
    assert body["recipients"] == [pb] and body["shape"] == list(X.shape) and body["classes"] == classes
    assert body["samples"] == len(y) and body["extractor"] == rec.blobs["extractor"]
    # the daemon's rule (mirrored by sync): only recipients fetch the envelope
    assert BlobStore(b.blobs_dir).has(shared.blob) and not BlobStore(c.blobs_dir).has(shared.blob)


def test_non_recipient_cannot_decrypt_even_holding_the_blob(trio, monkeypatch, capsys):
    a, b, c = trio
    pa, pb, pc = peer_ids(trio)
    shared = share_features(a, to=[pb])
    sync(trio)
    BlobStore(c.blobs_dir).put_bytes(BlobStore(a.blobs_dir).get_bytes(shared.blob))  # leaked envelope
    with pytest.raises(FeaturesError, match="not a recipient"):
        _open(c, shared.entry.id.hex())
    # through the CLI: one clear line, non-zero exit, no traceback
    monkeypatch.setattr(sys, "argv", ["atd", "aggregate", "--home", str(c.root), "--mode", "vertical",
                                      *ENSEMBLE_ARGS, "--features", shared.entry.id.hex()])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1
    assert "not a recipient" in err and "Traceback" not in err


def test_envelope_must_match_its_signed_entry(trio):
    a, b, c = trio
    pa, pb, pc = peer_ids(trio)
    shared = share_features(a, to=[pb])
    sync(trio)
    # c re-publishes a's envelope under its own name: b refuses it before decrypting
    body = dict(shared.entry.body)
    ident_c = NodeIdentity.load(c)
    with Ledger.open(c.ledger_db) as led:
        forged = led.append(ident_c.signer, "features", body)
    sync(trio)
    with pytest.raises(FeaturesError, match="differ from the signed entry"):
        _open(b, forged.id.hex())
    assert _open(b, shared.entry.id.hex()).sender == pa


def test_recipient_errors(trio):
    a, b, c = trio
    pa, pb, pc = peer_ids(trio)
    with Ledger.open(a.ledger_db) as led:
        with pytest.raises(FeaturesError, match="not a peer id"):
            recipient_keys(led, ["nonsense"])
        with pytest.raises(FeaturesError, match="not a member"):
            recipient_keys(led, [Signer.generate().peer_id])
        with pytest.raises(FeaturesError, match="at least one"):
            recipient_keys(led, [])
        assert set(recipient_keys(led, [pb, pc, pb])) == {pb, pc}
        quiet = Signer.generate()  # admitted, but its daemon never announced an X25519 key
        led.admit(NodeIdentity.load(a).signer, quiet.public_key)
        with pytest.raises(FeaturesError, match="no X25519 key"):
            recipient_keys(led, [pb, quiet.peer_id])
    r = runner.invoke(app, ["share-features", "--home", str(a.root), "--to", "12D3KooWnope"])
    assert isinstance(r.exception, FeaturesError)
    r = runner.invoke(app, ["share-features", "--home", str(a.root), "--to", pb, "--model", "nope"])
    assert r.exit_code != 0 and "nope" in str(r.exception)
