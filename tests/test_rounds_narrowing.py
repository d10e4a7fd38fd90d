"""A fast hostile member cannot leave a slow honest one out of a round (real daemons).

netsim.fat.run_rounds_memnet runs four real NodeDaemons on the in-memory network, each
running the `atd rounds` loop (`RoundRunner`). h0 is hostile (`netsim.hostile_rounds.
HurryingRunner`): it trains and publishes like anyone, then records the round's aggregate
as soon as it holds inputs from a majority (h0, h1, h2), naming h3 as missing. h3 is slow:
its local training takes 30 simulated seconds (the others' none), well inside the 120 s
deadline.
The hostile aggregate verifies and is final (3 of 4). Before the rule that a round waits
for every live member and refuses an aggregate that names as missing an input that
arrived in time, h1 and h2 adopted it at once (an adoptable aggregate ended their wait)
and h3 adopted it too (final): h3 was left out. Now every honest node ends on the aggregate over
all four inputs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atdnode.data import load_dataset
from atdnode.learning import ModelConfig
from netsim.fat import run_rounds_memnet
from netsim.hostile_rounds import HurryingRunner
from netsim.nodedata import subset

pytestmark = pytest.mark.slow  # four daemons, four tiny trainings (about 10 s)

torch.set_num_threads(1)

TINY = ModelConfig(name="vit_tiny_patch16_224", img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                   in_chans=1, num_classes=3)


def test_a_fast_hostile_member_cannot_exclude_a_slow_honest_one(tmp_path) -> None:
    tr = load_dataset("digits?classes=0,1,2", 8, 1, "train")
    names = [f"h{i}" for i in range(4)]
    parts = np.array_split(np.arange(160), 4)
    logs: list[str] = []
    res = run_rounds_memnet({n: subset(tr, p, tr.classes) for n, p in zip(names, parts)}, classes=list(tr.classes),
                            model=TINY, rounds=1, weighting="fedavg", deadline=120.0, hostile={"h0": HurryingRunner},
                            slow={"h3": 30.0}, work=tmp_path, log=logs.append)
    narrow = res.reports["h0"][0]
    assert len(narrow.inputs) == 3 and len(narrow.missing) == 1  # the attack happened: h3 named missing
    honest = [res.reports[n][0] for n in names[1:]]
    for rep in honest:
        assert len(rep.inputs) == 4 and rep.missing == [], rep
        assert rep.blob != narrow.blob
    assert res.identical
    refused = [m for m in logs if "not adopted: it names as missing" in m]
    assert any(m.startswith(("h1:", "h2:", "h3:")) for m in refused), logs
