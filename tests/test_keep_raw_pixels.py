"""A node never deploys a model that scores worse on its val split than what it has alone.

The keep decision's third candidate is the node's own raw-pixel ensemble
(`atdnode.aggregation.ensemble_refs.fit_own_raw`, fitted on its own training split only). Here the
classes differ by brightness — plain to an ensemble on raw pixels — and the learned model barely
trained (a near-zero learning rate), so on the val split the raw-pixel ensemble scores best: the
decision keeps it, registers it as a raw-pixel model, and `atd classify` without `--model`, the
model card's use line and `atd models` then use it. `choose` alone: the one-standard-error rule
— the consortium's model stays unless another candidate beats it on val by more than one SE of
the paired difference (`paired_balanced_accuracy_se`: seeded, class-stratified, paired); then
the best of the others wins, ties to the learned model.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from atdnode.aggregation.candidates import judge_candidates
from atdnode.aggregation.ensemble import EnsembleOptions
from atdnode.aggregation.keep import choose, use_of
from atdnode.blobs import BlobStore
from atdnode.learning import jeffreys_paired_balanced_accuracy_se, paired_balanced_accuracy_se
from atdnode.learning import run_classify as classify
from atdnode.models import RAW_PIXELS, ModelRecord, ModelRegistry, learned_model_in_use, model_in_use
from atdnode.report import collect_card
from tests.factories import cli, make_consortium
from tests.vgs_homes import train_node

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
OPTS = EnsembleOptions(pca_components=8, mlp_hidden=(16,), mlp_max_iter=100, rf_trees=10)


def _brightness_npz(path: Path) -> str:
    """Two classes told apart by brightness (dark vs bright noise), train / val / test splits."""
    rng = np.random.default_rng(0)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = np.arange(n) % 2
        x = rng.integers(0, 120, size=(n, 16, 16)) + 100 * y[:, None, None]
        return x.astype(np.uint8), y.astype(np.int64)

    (tx, ty), (vx, vy), (sx, sy) = split(48), split(24), split(24)
    np.savez(path, train_images=tx, train_labels=ty, val_images=vx, val_labels=vy, test_images=sx,
             test_labels=sy, classes=np.array(["dark", "bright"]))
    return f"npz:{path}"


def _scores(own: float, cons: float, raw: float, se_own: float | None = None, se_raw: float | None = None) -> dict:
    out = {"scored_on": "val", **{k: {"model": k, "kind": "model", "balanced_accuracy": v, "accuracy": v}
                                  for k, v in (("own", own), ("consortium", cons), (RAW_PIXELS, raw))}}
    for k, se in (("own", se_own), (RAW_PIXELS, se_raw)):
        if se is not None:
            out[k]["se"] = se
    return out


def test_choose_without_a_recorded_se_takes_the_best_candidate_and_ties_go_to_the_learned_models() -> None:
    assert choose("best", _scores(0.6, 0.7, 0.8))[0] == RAW_PIXELS
    assert choose("best", _scores(0.8, 0.7, 0.8))[0] == "own"
    assert choose("best", _scores(0.6, 0.8, 0.8))[0] == "consortium"
    assert choose("consortium", _scores(0.6, 0.7, 0.9))[0] == "consortium"
    kept, why = choose("best", _scores(0.6, 0.7, 0.8))
    assert "raw-pixel ensemble scores 0.800 > the consortium's 0.700 and its own model 0.600" in why


def test_a_difference_within_one_se_keeps_the_consortium() -> None:
    # a tiny skewed val split: own and raw pixels score higher, each by less than one SE of the difference
    kept, why = choose("best", _scores(0.750, 0.523, 0.682, se_own=0.25, se_raw=0.20))
    assert kept == "consortium", why
    assert "none beats it by more than one SE" in why and "own 0.750 (+0.227, SE 0.250)" in why, why
    assert choose("best", _scores(0.750, 0.523, 0.682))[0] == "own"  # the same scores with no SE: the best
    assert choose("best", _scores(0.75, 0.5, 0.625, se_own=0.25, se_raw=0.125))[0] == "consortium"  # exactly 1 SE


def test_a_clear_difference_keeps_the_better_candidate() -> None:
    kept, why = choose("best", _scores(0.750, 0.523, 0.682, se_own=0.10, se_raw=0.10))
    assert kept == "own" and "keeps its own (one-SE rule: own 0.750 (+0.227, SE 0.100)" in why, why
    assert choose("best", _scores(0.60, 0.50, 0.90, se_own=0.2, se_raw=0.1))[0] == RAW_PIXELS
    # once one beats the consortium clearly, the best of the others wins (ties: its own model)
    assert choose("best", _scores(0.80, 0.50, 0.70, se_own=0.4, se_raw=0.1))[0] == "own"
    assert choose("best", _scores(0.70, 0.50, 0.70, se_own=0.1, se_raw=0.1))[0] == "own"


def test_the_paired_se_is_seeded_stratified_and_paired() -> None:
    y = np.repeat([0, 1], 50)
    a = y.copy()
    b = y.copy()
    b[:10] = 1  # b misses 10 of class 0's 50; both right on class 1
    se = paired_balanced_accuracy_se(y, a, b, seed=0)
    assert se == paired_balanced_accuracy_se(y, a, b, seed=0) != paired_balanced_accuracy_se(y, a, b, seed=1)
    # stratified: class 0 keeps its 50, the recall difference is Binomial(50, 0.2) / 50, halved by the mean
    assert abs(se - np.sqrt(0.2 * 0.8 / 50) / 2) < 0.003, se
    # paired: two predictors with the very same errors differ by exactly 0 in every resample
    assert paired_balanced_accuracy_se(y, b, b.copy()) == 0.0
    # the same difference on a class four times larger is half as noisy
    y4, a4, b4 = np.repeat([0, 1], 200), np.repeat([0, 1], 200), np.repeat([0, 1], 200)
    b4[:40] = 1
    assert abs(paired_balanced_accuracy_se(y4, a4, b4) / se - 0.5) < 0.1


def test_the_jeffreys_se_sees_variance_where_the_stratified_bootstrap_sees_none() -> None:
    y = np.repeat([0, 1], [21, 3])
    a, b = y.copy(), y.copy()
    b[21:] = 0  # a right on all 3 of class 1, b wrong on all of them; both right on class 0
    assert paired_balanced_accuracy_se(y, a, b) == 0.0  # the empirical bootstrap sees no variance
    se = jeffreys_paired_balanced_accuracy_se(y, a, b, seed=0)
    assert se == jeffreys_paired_balanced_accuracy_se(y, a, b, seed=0) != jeffreys_paired_balanced_accuracy_se(y, a, b, seed=1)
    # class 1: a-only share ~ Beta(3.5, 1.5) less the b-only share; class 0: Dirichlet(21.5, .5, .5, .5); ~0.13
    assert 0.10 < se < 0.16, se
    # on a large split it agrees with the empirical bootstrap
    y4, a4, b4 = np.repeat([0, 1], 200), np.repeat([0, 1], 200), np.repeat([0, 1], 200)
    b4[:40] = 1
    assert abs(jeffreys_paired_balanced_accuracy_se(y4, a4, b4) / paired_balanced_accuracy_se(y4, a4, b4) - 1) < 0.1


def test_the_raw_pixel_ensemble_is_kept_when_best_on_val_and_classify_uses_it(tmp_path: Path) -> None:
    spec = _brightness_npz(tmp_path / "bright.npz")
    home = make_consortium(tmp_path / "homes", 1)[0]
    train_node(home, spec, epochs=1, lr=1e-7)  # a learned model that learned next to nothing
    reg = ModelRegistry(home)
    own = reg.get("latest")
    store = BlobStore.of(home)
    cons = ModelRecord.from_dict({**own.to_dict(), "id": "", "created": time.time(),
                                  "provenance": {**own.provenance, "kind": "global-vertical"}})
    verdict = judge_candidates(home, store, own, cons, spec, OPTS)
    c = verdict["candidates"]
    assert c["scored_on"] == "val" and c[RAW_PIXELS]["kind"] == RAW_PIXELS
    assert c[RAW_PIXELS]["balanced_accuracy"] > max(c["own"]["balanced_accuracy"], c["consortium"]["balanced_accuracy"])
    assert verdict["kept"] == RAW_PIXELS and "raw-pixel ensemble" in verdict["kept_why"], verdict
    # the one-SE rule's evidence: each other candidate's SE beside the consortium's, and the why says so
    assert "se" not in c["consortium"] and 0 < c[RAW_PIXELS]["se"] < c[RAW_PIXELS]["balanced_accuracy"] - \
        c["consortium"]["balanced_accuracy"] and "one-SE rule: raw pixels" in verdict["kept_why"], verdict
    raw = reg.get(c[RAW_PIXELS]["model"])  # registered, with no weights: its ensemble reads pixels
    assert raw.provenance["kind"] == RAW_PIXELS and "full" not in raw.blobs and raw.provenance["beside"] == own.id
    # the home indexes the fit: the next decision on the same data and options does not fit it again
    assert [json.loads(p.read_text())["ensemble"] for p in (home.cache_dir / "own-raw").glob("*.json")] == \
        [raw.blobs["ensemble"]]
    cons.provenance.update(verdict)
    agg = reg.add(cons)  # the aggregate's record, newest: the one the decision is written in
    use = model_in_use(home)
    assert use.record.id == raw.id and use.not_kept.id == agg
    res = classify(home, spec, split="test")  # no --model: the model in use
    learned = classify(home, spec, model=own.id, split="test")
    assert res.model_id == raw.id and res.kind == RAW_PIXELS
    assert res.metrics["balanced_accuracy"] > learned.metrics["balanced_accuracy"] + 0.2, (res.metrics, learned.metrics)
    assert use_of(home, raw)["status"] == "in use"
    assert use_of(home, reg.get(agg))["status"] == "not kept" and raw.id in use_of(home, reg.get(agg))["why"]
    card = collect_card(home)  # the model in use: says what it is and why it is in use
    assert card.model_id == raw.id and card.made_by == RAW_PIXELS and "raw pixels" in card.arch
    assert card.use["status"] == "in use" and "raw-pixel ensemble scores" in card.use["why"]
    assert learned_model_in_use(home).id == own.id  # the next decision's "own" candidate: the learned model
    out = cli("models", "--home", str(home.root))  # marked in use, made by raw-pixels, the decision shown
    assert re.search(rf"^\* +{raw.id} .* raw-pixels ", out, re.M) and "kept raw-pixels" in out, out


def test_a_val_split_with_too_few_images_of_a_class_cannot_overturn_the_consortium() -> None:
    from atdnode.aggregation.keep import MIN_VAL_PER_CLASS

    clear = _scores(0.95, 0.5, 0.6, se_own=0.01, se_raw=0.01)  # own beats the consortium by 45 SEs
    assert choose("best", clear)[0] == "own"  # records without the counts: the one-SE rule alone
    few = {**clear, "val_class_counts": {"benign": 22, "malignant": MIN_VAL_PER_CLASS - 3}}
    kept, why = choose("best", few)
    assert kept == "consortium", why
    assert "the split holds 2 image(s) of class 'malignant' (fewer than 5)" in why and "too few to rank" in why, why
    absent = {**clear, "val_class_counts": {"a": 30, "b": 0, "c": 1}}  # a class the split lacks counts as none
    assert choose("best", absent)[0] == "consortium" and "0 image(s) of class 'b' (fewer than 5; 2 classes short)" \
        in choose("best", absent)[1]
    enough = {**clear, "val_class_counts": {"benign": 19, "malignant": MIN_VAL_PER_CLASS}}
    assert choose("best", enough)[0] == "own"  # five of each: the one-SE rule decides
    assert choose("consortium", few)[0] == "consortium"


def test_answer_classes_are_the_ensembles_for_an_aggregate_and_the_heads_otherwise() -> None:
    from atdnode.models import answer_classes

    common = dict(model={}, label_fp="", samples=1, metrics={})
    aggregate = ModelRecord(labels=["0", "1"], blobs={"extractor": "e", "ensemble": "b"},
                            provenance={"ensemble_classes": ["0", "1", "2", "3"]}, **common)
    assert answer_classes(aggregate) == ["0", "1", "2", "3"]  # the union the consortium answers, not the node's own
    trained = ModelRecord(labels=["0", "1"], blobs={"full": "f"}, provenance={"ensemble_classes": ["x"]}, **common)
    assert answer_classes(trained) == ["0", "1"]  # no ensemble: its head's classes
