"""Federated adversarial training through `atd rounds` on netsim's daemons.

netsim.fat runs one campaign as real NodeDaemons on the in-memory network, each running the
`atdnode.rounds.runner.RoundRunner` the CLI runs (weights as signed entries + blobs, every round's
global model an `aggregate` entry every node recomputes). The setting of "Federated
Adversarial Training with Transformers" (Sec. 4) at laptop scale: K = 5 clients, the paper's
Non-IID(2) class partition, its local optimiser (SGD, momentum 0.9, rate decayed 5 % per
epoch), PGD on half of each batch; digits 28 px, ViT d=64 depth 2, from one shared initial
model pretrained (clean) on a public IID share -- the paper fine-tunes pretrained ViTs.

What is checked (numbers measured when written are in MEASURED):
- FedWAvg's weights (q = ROUNDS_Q) move off 1/K on Non-IID(2) shards -- by more than 0.05
  on average over 3 seeds, more than 4x (on average; 2x on every seed) what they move on
  IID shards (Sec. 3, Fig. 1 vs Fig. 6); with FedAvg in its place both deviations are 0 and
  the test fails;
- every FedWAvg weight is softmax(q * cosine) of the cosines recorded in its aggregate entry;
- robust accuracy (PGD-7, eps 8/255) over 3 seeds: the paper's gain over FedAvg (Tables 2-3)
  does NOT reproduce at this scale (mean +0.008, per seed -0.008 .. +0.028, inside the
  seed-to-seed spread of 0.05); what holds and is
  asserted: FedWAvg's mean robust accuracy is within ROBUST_MARGIN of FedAvg's and no seed is
  worse by more than 1.5x that, both score clean accuracy > 3x chance, and every campaign's
  global model moved off the shared start (a campaign that trained nothing returns the start
  and fails). Whether two Non-IID(2) rounds fit the adversarial objective on the clients'
  shards beyond the clean-pretrained start is NOT asserted: at this scale it turns on the
  machine's float arithmetic (on one CPU every campaign gained PGD-7 accuracy on the shards, on
  another FedAvg lost some on two of three seeds).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from atdnode.data import load_dataset, without_val
from atdnode.learning import ModelConfig, build_model
from atdnode.learning import TrainOptions
from netsim.fat import pgd_config, run_rounds_memnet
from netsim.learn import full_state, train_model
from netsim.nodedata import subset
from netsim.partition import _rng, iid, non_iid
from netsim.run import run_scenario
from netsim.scenario import ScenarioError, scenario_from_dict
from protocols.adversarial import robust_accuracy
from protocols.fedwavg import ROUNDS_Q, softmax_weights

torch.set_num_threads(1)

K = 5
MODEL = ModelConfig(name="vit_tiny_patch16_224", img_size=28, patch_size=7, embed_dim=64, depth=2, num_heads=4,
                    in_chans=1, num_classes=10)
PUBLIC = 720  # IID "public" share of digits' train split the shared initial model is pretrained on
PER_CLIENT = 100  # private training samples per client
ROUNDS = 2
SEEDS = (0, 1, 2)
SGD = {"optimizer": "sgd", "lr": 0.02, "lr_decay": 0.05}  # the paper's local optimiser (its rate: 0.1 at ViT-S scale)
TRAIN_PGD = pgd_config(steps=2)  # training: half of each batch replaced by PGD-2 examples (eps 8/255)
EVAL_PGD = pgd_config(steps=7)  # PGD-7 as the paper
ROBUST_MARGIN = 0.02
MIN_MOVE = 1e-3  # relative L2 distance of a campaign's global model from the shared start
MEASURED = {  # seed: (FedAvg clean, robust), (FedWAvg clean, robust), FedWAvg max |w - 1/K| (IID, seed 0: 0.014)
    0: ((0.671, 0.198), (0.630, 0.201), 0.137),
    1: ((0.652, 0.175), (0.630, 0.167), 0.094),
    2: ((0.649, 0.150), (0.674, 0.178), 0.053),
}


@pytest.fixture(scope="module")
def digits():
    """digits' whole training split (no val carved: the campaigns select nothing, and the
    public share, the shards and MEASURED are drawn from all of it) and its test split."""
    spec = without_val("digits")
    return load_dataset(spec, 28, 1, "train"), load_dataset(spec, 28, 1, "test")


@pytest.fixture(scope="module")
def pretrained(digits):
    """The shared initial model (clean AdamW on the public share) and the private indices."""
    tr, _ = digits
    perm = _rng(0, "fat-public").permutation(len(tr))
    public, private = np.sort(perm[:PUBLIC]), np.sort(perm[PUBLIC:])
    pre = train_model(MODEL, subset(tr, public, tr.classes), TrainOptions(epochs=6, batch_size=16, lr=3e-3, augment=False),
                      seed=0, warmup_epochs=0.0)
    return full_state(pre.model), private


def capped(parts: list[np.ndarray], seed: int) -> list[np.ndarray]:
    return [np.sort(p[_rng(seed, f"fat-cap{k}").permutation(len(p))[:PER_CLIENT]]) for k, p in enumerate(parts)]


def campaign(tr, parts: list[np.ndarray], weighting: str, *, seed: int, init):
    train = {f"h{k}": subset(tr, p, tr.classes) for k, p in enumerate(parts)}
    return run_rounds_memnet(train, classes=list(tr.classes), model=MODEL, rounds=ROUNDS, weighting=weighting,
                             q=ROUNDS_Q, adversarial=TRAIN_PGD, batch_size=16, seed=seed, init_state=init, **SGD)


def deviation(run) -> float:
    return max(abs(w - 1 / K) for x in run.per_round() for w in x["weights"])


@pytest.fixture(scope="module")
def non_iid2(digits, pretrained):
    """FedAvg and FedWAvg campaigns on the same Non-IID(2) shards for each seed; their runs
    and clean / PGD-7 accuracies on the test split."""
    tr, te = digits
    init, private = pretrained
    out = {}
    for seed in SEEDS:
        parts = shards(tr, private, seed)
        for w in ("fedavg", "fedwavg"):
            r = campaign(tr, parts, w, seed=seed, init=init)
            s = robust_accuracy(r.model(), (te.images, te.labels), generator=torch.Generator().manual_seed(0),
                                **EVAL_PGD.attack_kwargs())
            out[seed, w] = (r, s)
    print(json.dumps({f"{sd} {w}": {"clean": s.clean, "robust": s.robust, "max_dev": deviation(r),
                                    "weights": [x["weights"] for x in r.per_round()]}
                      for (sd, w), (r, s) in out.items()}))
    return out


def shards(tr, private, seed: int) -> list[np.ndarray]:
    return capped(non_iid(private, tr.labels.numpy(), K, _rng(seed, "fat-noniid"), classes_per_node=2), seed)


def test_non_iid_partitions_give_each_client_c_classes(digits) -> None:
    labels = digits[0].labels.numpy()
    idx = np.arange(len(labels))
    two = non_iid(idx, labels, 5, _rng(0, "t"), classes_per_node=2)
    assert [len(np.unique(labels[p])) for p in two] == [2] * 5
    assert len(np.unique(np.concatenate(two))) == len(idx)  # disjoint and complete: 5 x 2 = 10 classes
    four = non_iid(idx, labels, 5, _rng(0, "t"), classes_per_node=4)
    assert [len(np.unique(labels[p])) for p in four] == [4] * 5
    assert sorted(np.concatenate(four).tolist()) == idx.tolist()  # each sample once; each class on 2 clients
    with pytest.raises(ScenarioError, match="non_iid"):
        non_iid(idx, labels, 5, _rng(0, "t"), classes_per_node=11)


@pytest.mark.slow
def test_rounds_agree_on_every_node_record_cosines_and_learn(non_iid2, pretrained) -> None:
    init, _ = pretrained
    start = torch.cat([v.flatten().float() for v in init.values()])
    for (seed, w), (r, s) in non_iid2.items():
        rounds = r.per_round()
        assert r.identical and all(x["identical"] and not x["missing"] for x in rounds), (seed, w)
        assert all(len(x["weights"]) == K for x in rounds)
        assert s.clean > 0.3, (seed, w, s)  # learned: 3x chance (10 classes)
        # the rounds trained: the global model left the shared start (a no-op campaign returns it)
        state = r.model().state_dict()
        end = torch.cat([state[k].flatten().float() for k in init])
        assert float((end - start).norm() / start.norm()) > MIN_MOVE, (seed, w)
        for x in rounds:
            if w == "fedavg":
                assert x["weights"] == [1 / K] * K and x["cosines"] is None
            else:  # the weights are Eq. 3 of the recorded cosines
                assert len(x["cosines"]) == K
                assert np.allclose(softmax_weights(np.array(x["cosines"]), q=ROUNDS_Q), x["weights"], atol=1e-12)


@pytest.mark.slow
def test_fedwavg_weights_move_off_uniform_on_non_iid2_not_on_iid(digits, pretrained, non_iid2) -> None:
    """Sec. 3: under IID the weights stay near 1/K; under Non-IID adversarial training they
    move away. FedAvg in FedWAvg's place gives 0 for both and fails."""
    tr, _ = digits
    init, private = pretrained
    skewed = [deviation(non_iid2[sd, "fedwavg"][0]) for sd in SEEDS]
    r = campaign(tr, capped(iid(private, K, _rng(0, "fat-iid")), 0), "fedwavg", seed=0, init=init)
    flat = deviation(r)
    print("max |w - 1/K|: Non-IID(2)", skewed, "IID", flat)
    mean = sum(skewed) / len(skewed)
    assert mean > 0.05, skewed
    assert mean > 4 * flat and min(skewed) > 2 * flat, (skewed, flat)


@pytest.mark.slow
def test_fedwavg_robust_accuracy_against_fedavg_over_seeds(non_iid2) -> None:
    """The paper's claim is a robust gain on Non-IID(2) (Table 3). At this scale it does not
    reproduce (MEASURED): assert what holds -- no loss beyond ROBUST_MARGIN on the mean over
    seeds, none beyond 1.5x that on any seed -- and that the two methods trained different
    models (FedWAvg is not FedAvg in disguise)."""
    rob = {w: [non_iid2[sd, w][1].robust for sd in SEEDS] for w in ("fedavg", "fedwavg")}
    diff = [a - b for a, b in zip(rob["fedwavg"], rob["fedavg"])]
    print("robust accuracy", rob, "FedWAvg - FedAvg", diff)
    assert sum(diff) / len(diff) > -ROBUST_MARGIN, diff
    assert min(diff) > -1.5 * ROBUST_MARGIN, diff
    assert any(d != 0 for d in diff)


TINY = {
    "scenario": {"name": "fat", "seed": 1, "methods": ["fedavg", "fat-fedwavg"], "step_deadline_s": 60},
    "model": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2},
    "train": {"epochs": 1, "lr": 3e-3},
    "baselines": {"rounds": 2, "pgd_steps": 1, "optimizer": "sgd", "lr_decay": 0.05},  # the paper's local SGD
    "datasets": [{"name": "digits", "spec": "digits"}],
    "cohorts": [{"name": "a", "nodes": ["a1", "a2", "a3"], "dataset": "digits", "classes": ["0", "1", "2"],
                 "partition": "non_iid2", "train_samples": 120, "test_samples": 30}],
}


def test_netsim_scenario_runs_fedavg_and_fat_methods_through_atd_rounds(tmp_path) -> None:
    rep = run_scenario(scenario_from_dict(json.loads(json.dumps(TINY))), tmp_path / "out")
    for m in ("fedavg", "fat-fedwavg"):
        (ph,) = rep["methods"][m]
        assert set(ph["per_node"]) == {"a1", "a2", "a3"} and "accuracy" in ph["overall"]
        assert all(ph["bytes"][n]["sent"] > 0 and ph["bytes"][n]["received"] > 0 for n in ("a1", "a2", "a3"))
        assert "server" not in ph["bytes"] and ph["notes"][0].startswith("atd rounds")
    assert "robust_accuracy" in rep["methods"]["fat-fedwavg"][0]["overall"]
    assert "robust_accuracy" not in rep["methods"]["fedavg"][0]["overall"]
    assert "fat-fedwavg phase 1: clean accuracy" in (tmp_path / "out" / "report.md").read_text()


def test_fedprox_and_unknown_optimisers_are_refused_with_the_key_named() -> None:
    raw = json.loads(json.dumps(TINY))
    raw["baselines"]["fedprox_mu"] = 0.1
    with pytest.raises(ScenarioError, match=r"baselines.fedprox_mu: FedProx is not offered"):
        scenario_from_dict(raw)
    raw = json.loads(json.dumps(TINY))
    raw["baselines"]["optimizer"] = "rmsprop"
    with pytest.raises(ScenarioError, match=r"baselines.optimizer: must be one of adamw, sgd \(got 'rmsprop'\)"):
        scenario_from_dict(raw)
