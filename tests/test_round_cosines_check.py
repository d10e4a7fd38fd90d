"""A round aggregate's recorded FedWAvg cosines are checked on verification: a
member that records the right weights beside made-up cosines is caught; the honest record,
and a record without cosines (FedAvg, older entries), pass."""
from __future__ import annotations

import pytest

from atdnode.aggregation import check_recorded_cosines
from atdnode.errors import AtdError
from ledger import Entry
from ledger.keys import Signer


def _entry(body: dict) -> Entry:
    return Entry.create(Signer.from_seed(bytes(32)), seq=1, prev=b"\0" * 32, lamport=1, kind="aggregate", body=body)


def test_recorded_cosines_must_be_the_inputs_cosines() -> None:
    real = [0.91, 0.42, -0.13]
    check_recorded_cosines(_entry({"mode": "round", "cosines": list(real)}), real)  # honest: passes
    check_recorded_cosines(_entry({"mode": "round"}), real)  # nothing recorded: nothing to check
    with pytest.raises(AtdError, match="recorded cosines"):
        check_recorded_cosines(_entry({"mode": "round", "cosines": [0.91, 0.42, 0.99]}), real)
    with pytest.raises(AtdError, match="malformed cosines"):
        check_recorded_cosines(_entry({"mode": "round", "cosines": [0.91, 0.42]}), real)
