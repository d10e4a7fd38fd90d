"""Robust round aggregators (`atd rounds --aggregator`, protocols.robust): what one hostile
member of five can do to the global model, what robustness costs without an attack, and
that every member recomputes and verifies a robust round.

In-process homes (tests.vgs_homes: real ledgers, keys, blob stores, training): five members
train round 0 from the shared initial model on IID shards of digits' classes 0-2 (chance
1/3); the globals are `atdnode.rounds.rules.compute_round`, the function `atd rounds` and
its verification call. The attack: the fifth member's input replaced by the reference
(the initial model) x -1000, a verifiable input that FedAvg averages in.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from atdnode import bodies
from atdnode.aggregation import AggregateError
from atdnode.data import load_dataset
from atdnode.learning import build_model
from atdnode.models import load_weights, save_weights
from atdnode.node import NodeIdentity
from atdnode.rounds import RoundsError, verify_round
from atdnode.rounds import active_members, round_weights_entries
from atdnode.rounds.rules import compute_round
from atdnode.rounds import RoundRunner, RoundsConfig
from ledger import Ledger
from netsim.learn import predict
from protocols.robust import coordinate_median, krum_select, pairwise_sq_distances, trimmed_mean
from protocols.rounds import AGGREGATORS
from tests.vgs_homes import cfg, consortium, sync

pytestmark = pytest.mark.slow  # five tiny trainings (about 5 s)

torch.set_num_threads(1)

N = 5
DATA = "digits?classes=0,1,2&shard={i}/5&limit=300"
ROBUST = [a for a in AGGREGATORS if AGGREGATORS[a].robust]
CHANCE = 1 / 3


def flat(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t[k].double().reshape(-1) for k in sorted(t)])


@pytest.fixture(scope="module")
def round0(tmp_path_factory):
    """Five members' round-0 inputs, the same inputs with the fifth poisoned, a runner."""
    homes = consortium(tmp_path_factory.mktemp("robust") / "homes", [f"m{i}" for i in range(N)])
    rs = [RoundRunner(h, RoundsConfig(data=DATA.format(i=i + 1), cfg=cfg(), rounds=1, lr=3e-3, local_epochs=3,
                                      weighting="fedavg")) for i, h in enumerate(homes)]
    for r in rs:
        r.publish(0, r.train_round(0, r.init))
    sync(homes)
    ra = rs[0]
    with Ledger.open(homes[0].ledger_db) as led:
        honest = round_weights_entries(led, ra.campaign, 0, ra.init)
    victim = next(e for e in honest if e.author == NodeIdentity.load(homes[-1]).public_key)
    tensors, meta = load_weights(ra.store, ra.init)
    evil = save_weights(ra.store, {k: v * -1000.0 for k, v in tensors.items()}, meta)
    with Ledger.open(homes[0].ledger_db) as led:  # the poisoned input (signed by m0: the arithmetic ignores authors)
        bad = bodies.append(led, NodeIdentity.load(homes[0]).signer, "weights",
                            {**victim.body, "blob": evil, "size": ra.store.size(evil),
                             "manifest": ra.store.manifest(evil).hash})
    attacked = sorted([e for e in honest if e.id != victim.id] + [bad], key=lambda e: e.id.hex())
    return ra, honest, attacked


def global_of(ra: RoundRunner, inputs, rule: str) -> dict[str, torch.Tensor]:
    return compute_round(ra.store, inputs, weighting=rule, q=1.0, reference=ra.init, byzantine=1)[1][0]


def test_one_hostile_member_of_five_moves_robust_globals_less_than_the_honest_spread(round0) -> None:
    ra, honest, attacked = round0
    xs = [flat(load_weights(ra.store, e.body["blob"])[0]) for e in honest]
    spread = max(float((a - b).norm()) for a in xs for b in xs)  # the honest inputs' diameter
    moved = {rule: float((flat(global_of(ra, attacked, rule)) - flat(global_of(ra, honest, rule))).norm())
             for rule in ["fedavg", *ROBUST]}
    print("honest spread", spread, "moved by the attack", moved)
    assert moved["fedavg"] > 100 * spread  # the documented limit: FedAvg averages the attack in
    for rule in ROBUST:
        assert moved[rule] < spread, (rule, moved[rule], spread)


def test_without_an_attack_robust_globals_lose_at_most_two_points_against_fedavg(round0) -> None:
    ra, honest, _ = round0
    te = load_dataset(DATA.split("&")[0], ra.cfg.img_size, ra.cfg.in_chans, "test")

    def accuracy(rule: str) -> float:
        m = build_model(ra.cfg)
        m.load_state_dict(global_of(ra, honest, rule))
        return float((predict(m, te.images) == te.labels.numpy()).mean())

    acc = {rule: accuracy(rule) for rule in ["fedavg", *ROBUST]}
    print("test accuracy (chance 1/3, %d samples)" % len(te), acc)
    assert acc["fedavg"] > CHANCE + 0.15  # the round learned: what robustness may cost is measurable
    for rule in ROBUST:
        assert acc[rule] > acc["fedavg"] - 0.02, (rule, acc)


def test_a_robust_round_is_recorded_and_verified_and_its_rule_is_checked(round0) -> None:
    ra, honest, _ = round0
    with Ledger.open(ra.home.ledger_db) as led:
        members = active_members(led)
    # a member of the FedAvg campaign that computes its rounds with the median instead
    rm = RoundRunner(ra.home, RoundsConfig(data=DATA.format(i=1), cfg=cfg(), rounds=1, weighting="median"))
    rm.campaign = ra.campaign
    entry = rm.record(0, honest, members, rm.init)
    assert entry.body["aggregator"] == "median" and entry.body["byzantine"] == 1 and entry.body["missing"] == []
    with Ledger.open(ra.home.ledger_db) as led:  # any member recomputes it bit for bit
        assert verify_round(led, ra.store, entry, rm.init) == entry.body["blob"]
        # the same inputs under another rule's name do not verify: the rule is part of the record
        renamed = bodies.append(led, ra.ident.signer, "aggregate", {**entry.body, "aggregator": "trimmed-mean"})
        with pytest.raises(AggregateError, match="does not verify"):
            verify_round(led, ra.store, renamed, rm.init)
    with pytest.raises(RoundsError, match="not the campaign's fedavg"):  # verifies, yet not this campaign's rule
        trio.run(ra.adopt, entry)


def test_robust_rules_on_small_tensors() -> None:
    vals = [torch.tensor([1.0, -2.0]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 5.0]),
            torch.tensor([1e6, -1e6])]
    assert coordinate_median(vals).tolist() == [2.5, -1.0]  # even count: mean of the two middle values
    assert trimmed_mean(vals, 1).tolist() == [2.5, -1.0]
    assert trimmed_mean(vals[:3], 5).tolist() == [2.0, 0.0]  # trimming capped: one value stays
    d = pairwise_sq_distances([[v] for v in vals])
    assert d[0, 1] == 5.0 and np.allclose(d, d.T)
    assert krum_select(d, 1) == [0] and krum_select(d, 1, m=3) == [0, 1, 2]  # tie to the earlier; never the outlier
    with pytest.raises(Exception, match="shape"):
        coordinate_median([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(Exception, match="non-finite"):
        trimmed_mean([torch.zeros(2), torch.tensor([float("nan"), 0.0])], 0)
