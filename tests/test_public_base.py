"""`base = "public"` (VGS-ATD §3.2's W_p): the public pool is disjoint from every
node's private and test data by source digit, W_p is trained on the pool only, and every
method that trains a model (VGS-ATD, centralized, local) starts from it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.netsim_tiny import TINY

POOL = "digits-jitter?variants=2&public=0.3&part=public"


def _pixels(data) -> set[bytes]:
    return {x.numpy().tobytes() for x in data.images}


def test_public_pool_is_disjoint_from_private_train_and_test_by_source_digit() -> None:
    from atdnode.data import load_dataset, without_val
    from atdnode.data.jitter import digits_jitter_catalog, public_digits
    from sklearn.datasets import load_digits

    targets = load_digits().target
    mask = public_digits(targets, 0.3)
    assert abs(mask.mean() - 0.3) < 0.01 and set(np.unique(targets[mask])) == set(range(10))  # every class
    assert not (public_digits(targets, 0.2) & ~mask).any()  # nested: a smaller pool is inside a larger one
    pub, priv = digits_jitter_catalog(3, public=0.3, part="public"), digits_jitter_catalog(3, public=0.3)
    assert not set(pub.groups) & set(priv.groups)  # no source digit on both sides
    assert len(set(pub.groups)) + len(set(priv.groups)) == len(targets)
    # the loaded splits: one rendering (variant 0) per digit on each side, so a digit on both
    # sides would give one identical image (the renderer is a pure function of digit and seed)
    # (the source has no val split, so each side's val is carved from its train: all three splits count)
    def every_split(spec: str) -> set[bytes]:
        return set().union(*(_pixels(load_dataset(spec, 32, 1, s)) for s in ("train", "val", "test")))

    pool = every_split("digits-jitter?public=0.3&part=public")
    private = every_split("digits-jitter?public=0.3")
    everything = every_split("digits-jitter")
    assert len(pool) + len(private) == len(everything) == len(targets) and not pool & private
    # with `val=train` (how netsim reads the pool: nothing carved) train and test alone cover the pool
    whole = without_val("digits-jitter?public=0.3&part=public")
    assert _pixels(load_dataset(whole, 32, 1, "train")) | _pixels(load_dataset(whole, 32, 1, "test")) == pool


def _raw(**public) -> dict:
    raw = json.loads(json.dumps(TINY))
    raw["scenario"].update(base="public")
    raw["datasets"] = [{"name": "digits", "spec": "digits-jitter?public=0.3"}]
    raw["cohorts"] = raw["cohorts"][:1]  # phase 1 only: two nodes
    raw["public"] = {"spec": POOL, "epochs": 1, "lr": 3e-3, "finetune_lr": 1e-3, "finetune_epochs": 1, **public}
    return raw


def test_public_base_scenario_refuses_an_overlapping_pool() -> None:
    from netsim.scenario import ScenarioError, scenario_from_dict

    scn = scenario_from_dict(_raw())
    assert scn.base == "public" and scn.public.finetune_lr == 1e-3
    bad = _raw()
    bad["datasets"][0]["spec"] = "digits-jitter"  # the nodes would hold the pool's digits too
    with pytest.raises(ScenarioError, match="overlaps the public pool"):
        scenario_from_dict(bad)
    for change, where in (({"spec": ""}, "public.spec"), ({"spec": "digits-jitter?public=0.3"}, "public.spec"),
                          ({"spec": "digits-jitter?public=0.2&part=public"}, "public.spec"),
                          ({"epochs": 0}, "public.epochs"), ({"finetune_lr": 0}, "public.finetune_lr")):
        with pytest.raises(ScenarioError, match=where.replace(".", r"\.")):
            scenario_from_dict(_raw(**change))


@pytest.mark.slow
def test_netsim_base_public_every_method_starts_from_w_p(short_tmp: Path, monkeypatch) -> None:
    _run_public(short_tmp, monkeypatch)


def _run_public(tmp: Path, monkeypatch) -> None:
    import netsim.baselines as baselines
    from atdnode.blobs import BlobStore
    from atdnode.data import without_val
    from atdnode.node import NodeHome
    from atdnode.models import ModelRegistry, read_meta
    from netsim.publicbase import DESIGNATED, load_extractor
    from netsim.run import run_scenario
    from netsim.scenario import scenario_from_dict

    starts: list[dict | None] = []  # what every in-process baseline training started from
    real = baselines.train_model

    def spy(*a, **kw):
        starts.append(kw.get("init"))
        return real(*a, **kw)

    monkeypatch.setattr(baselines, "train_model", spy)
    rep = run_scenario(scenario_from_dict(_raw()), keep_homes=tmp)
    (work,) = [p for p in tmp.iterdir() if p.is_dir()]
    wp_file = work / "public" / "base" / "wp.safetensors"
    wp = load_extractor(wp_file)
    # W_p is the designated client's `atd train` on the pool, and nothing else
    (rec,) = ModelRegistry(NodeHome.at(work / "public" / "h" / DESIGNATED)).list()
    # read with `val=train`: W_p chooses nothing, so nothing of the pool is carved away as val
    assert rec.provenance["data"] == without_val(POOL) == POOL + "&val=train"
    assert rec.provenance["init_from"] is None
    assert rep["public_base"]["pool"] == POOL and rep["public_base"]["pool_train_images"] == rec.samples
    wp_base = read_meta(BlobStore(NodeHome.at(work / "public" / "h" / DESIGNATED).blobs_dir),
                        rep["public_base"]["blob"])["base"]
    # VGS-ATD: every trained model descends from W_p at the fine-tuning recipe; the founder
    # (and a node trained from nothing) starts from W_p's very blob
    inits = []
    for n in ("a1", "a2"):
        trained = [r for r in ModelRegistry(NodeHome.at(work / "vgs" / "homes" / n)).list() if r.provenance.get("run_key")]
        assert trained and all(r.provenance["base"] == wp_base for r in trained)
        assert all(r.provenance["options"]["lr"] == 1e-3 for r in trained)  # [public] finetune_lr
        inits += [r.provenance["init_from"] for r in trained]
    assert rep["public_base"]["blob"] in inits
    # centralized and local: each of their trainings started from W_p's extractor
    assert len(starts) == 3  # centralized phase 1, local a1 and a2
    for s in starts:
        assert s is not None and s.keys() == wp.keys() and all(torch.equal(s[k], wp[k]) for k in wp)
    # every method scored each node on its whole test split (a method that ran nothing scores nothing)
    tests = {n: rep["nodes"][n]["test"] for n in ("a1", "a2")}
    for m in ("vgs-atd", "centralized", "local", "ensemble-raw", "ensemble-untrained", "ensemble-public"):
        res = rep["methods"][m][0]
        assert {n: r["n"] for n, r in res["per_node"].items()} == tests and res["overall"]["nodes"] == 2, m
    # VGS-ATD from W_p learned the three classes: above the balanced accuracy of any constant answer (1/3)
    assert rep["methods"]["vgs-atd"][0]["overall"]["balanced_accuracy"] > 1 / 3 + 0.05
    assert any("W_p's features" in v for v in rep["feature_verdicts"])
