"""The two checks every aggregate verification ends with: recorded weights and result hash.

Shared by `atdnode.aggregation.verify` (VGS-ATD entries) and `atdnode.rounds.runner` (round entries) in a
module of their own: `agg_verify` hands round entries to `rounds`, so `rounds` importing
`agg_verify` made an import circle.
"""
from __future__ import annotations

import numpy as np
import torch

from atdnode.aggregation.aggregate import AggregateError
from atdnode.blobs import BlobStore
from atdnode.models import save_weights
from ledger import Entry

_WEIGHT_TOL = 1e-12  # recorded vs recomputed weights (both float64 from the same formula)


def check_recorded_weights(entry: Entry, expected: list[float]) -> list[float]:
    """The entry's recorded weights, if they are what its weighting rule gives; else AggregateError."""
    got = entry.body.get("weights")
    if not isinstance(got, list) or len(got) != len(expected) or not all(isinstance(x, float) for x in got):
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} records malformed weights {got!r}")
    if not np.allclose(got, expected, rtol=0.0, atol=_WEIGHT_TOL):
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} does not verify: recorded weights "
                             f"{[round(x, 6) for x in got]} are not the {entry.body.get('weighting')} weights of its "
                             f"inputs {[round(x, 6) for x in expected]}")
    return got


def check_recorded_cosines(entry: Entry, expected: list[float]) -> None:
    """A round's recorded FedWAvg cosines (optional) must be those of its inputs against its
    reference; else AggregateError. The weights are checked on their own, so this catches a
    recorder that writes correct weights beside made-up cosines (what a reader would trust)."""
    if "cosines" not in entry.body:
        return
    got = entry.body["cosines"]
    if not isinstance(got, list) or len(got) != len(expected) or not all(isinstance(x, float) for x in got):
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} records malformed cosines {got!r:.200}")
    if not np.allclose(got, expected, rtol=0.0, atol=_WEIGHT_TOL):
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} does not verify: recorded cosines "
                             f"{[round(x, 6) for x in got]} are not its inputs' {[round(x, 6) for x in expected]}")


def check_result(store: BlobStore, entry: Entry, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """The recomputed result must hash to the recorded blob. It is serialised in a scratch
    store first, so a mismatch leaves nothing behind; a match is kept (we now hold it)."""
    import tempfile

    recorded = entry.body.get("blob")
    with tempfile.TemporaryDirectory(prefix="atd-verify-") as tmp:
        scratch = BlobStore(tmp)
        blob = save_weights(scratch, tensors, meta)
        if blob != recorded:
            raise AggregateError(f"aggregate {entry.id.hex()[:16]} does not verify: recomputed result {blob[:16]}, "
                                 f"recorded {str(recorded)[:16]}")
        if not store.has(blob):
            store.put_file(scratch.path(blob))
    return blob
