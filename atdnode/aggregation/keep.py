"""Collaboration never silently makes a hospital worse; which model the node uses.

After every aggregation the node scores each candidate — its own current model (what it
predicted with before: `own`), the consortium's aggregate (`consortium`) and what it has
alone with no learning at all (`raw-pixels`: the PCA -> MLP + RF + SVM ensemble on the raw
pixels of its own training images, with the same class-prior correction,
`atdnode.aggregation.ensemble_refs.fit_own_raw`) — on its own validation data, with `atd
classify`'s predictor (`atdnode.aggregation.candidates.judge_candidates`, which applies
`choose` below), so a node never deploys a model that scores worse on its val split than what
it has alone:

* the data spec's `val` split: the source's, or one carved from its training split when the
  source has none (`atdnode.data.loader`) — never its test split unless the spec forces it
  (`val=test`, flagged with a warning wherever the numbers show);
* the scores go into the new model's record (`provenance["candidates"]`, shown by
  `atd models` and printed by `atd aggregate`) and into each model's evaluations;
* the policy `[aggregate] keep` in config.toml decides which model `atd classify` uses by
  default (`atdnode.models.default_model`): `best` (default) keeps the consortium's model unless
  the val split holds at least five images of every class (where the node holds all the
  consortium's classes) and another candidate beats it by more than one standard error there
  (below), else the best of the
  node's own model and its raw-pixel ensemble (ties: own); `consortium` always takes it. `provenance["kept"]` / `["kept_why"]`
  say what was kept and why. A kept raw-pixel ensemble is registered as a model of its own
  (provenance kind `raw-pixels`, `atdnode.learning.predict.RAW_PIXELS`: no weights, its
  ensemble reads flattened pixels) that `atd classify` and `atd predict` use.

The judge is `SELECT_BY`, balanced accuracy (the mean of the per-class recalls): hospitals'
val splits are skewed, and on a split that is 96 % one class a model that always answers
that class scores 0.96 accuracy but 0.5 balanced accuracy. Balanced accuracy rather than
AUROC because it judges the decisions `atd classify` makes (argmax, with the class-prior
correction applied), is defined the same way for two classes and for many, and needs only
the predictions every candidate kind (head or ensemble) yields; AUROC ranks scores and can
rate a model whose every answer is the majority class highly.

`best` is the one-standard-error rule (Breiman, Friedman, Olshen & Stone 1984, CART ch. 3;
Hastie, Tibshirani & Friedman, The Elements of Statistical Learning §7.10): among candidates
whose scores differ by less than their noise, take the one preferred before looking — here the
consortium's model, trained on the most data. A hospital's val split is small (tens of images,
a few of the rarer class), so its ranking of candidates a few points apart is noise, and
"the highest val score" picks whichever candidate the draw of those few images favoured, often
a model that answers the majority class. So the consortium's model is kept unless another
candidate beats it by more than one standard error of the paired difference in balanced
accuracy, estimated by a seeded, class-stratified paired bootstrap over the val images
(`atdnode.learning.metrics.paired_balanced_accuracy_se`; each candidate's "se" in the scores).

Before any of that, a val split too small to rank the candidates cannot overturn the
consortium: when the node's data holds every class of the consortium's model and its val split
holds fewer than `MIN_VAL_PER_CLASS` (5) images of one of them (none, for a class the split
lacks), `best` keeps the consortium's model and says which class was short. A node that holds
only some of the consortium's classes (a vertical joiner, a label-skewed founder) is judged by
the one-SE rule alone: its own model knows only its classes, so its advantage on its own data is
one of label space, not of a few images' luck, and the measurement below covers nodes that share
the consortium's label space only. A class's recall measured on n images moves in steps of 1/n and
its 95 % interval spans most of [0, 1] for n < 5 (Clopper–Pearson, 2 of 2 right: 0.16-1.0),
and the bootstrap sees no variance at all in a class where one candidate is right on every
image and the other on none — exactly the split where a model that always answers the
majority class looks best. Five is the usual least count per cell for a count to be treated as
evidence (Cochran 1954, "Some methods for strengthening the common χ² tests"). The rule was
chosen on val data only: `bench/medmnist_recipe_bench.py --keep-rules` scores each rule's pick
on the other sites' val splits (balanced accuracy does not depend on the class prior, and every
site draws from the same pool), where it beat the one-SE rule alone on both shared real-image
sets, whose sites all hold every class (numbers in RESULTS.md, "Real medical images").

Which model the node uses follows from those records alone (`atdnode.models.model_in_use`,
in the registry's room, read by `atd classify`, `atd predict`, the dashboard, `atd models`
and, through `use_of` here, the model card).
"""
from __future__ import annotations

from atdnode.errors import ConfigError
from atdnode.node import NodeHandle, NodeHome
from atdnode.models import RAW_PIXELS, ModelRecord, ModelRegistry, model_in_use

KEEP_POLICIES = ("best", "consortium")
MIN_VAL_PER_CLASS = 5  # fewer val images of a class than this: the split cannot overturn the consortium
DEFAULT_KEEP = "best"
SELECT_BY = "balanced_accuracy"


def keep_policy(home: NodeHome) -> str:
    """`[aggregate] keep` of the node's config.toml (default best)."""
    try:
        table = NodeHandle.of(home).config.extra.get("aggregate", {})
    except ConfigError:
        return DEFAULT_KEEP
    keep = table.get("keep", DEFAULT_KEEP) if isinstance(table, dict) else None
    if keep not in KEEP_POLICIES:
        raise ConfigError(f"config: aggregate.keep must be one of {', '.join(KEEP_POLICIES)}, got {keep!r}")
    return keep


CANDIDATES = ("consortium", "own", RAW_PIXELS)  # the order ties are broken in
WHAT = {"consortium": "the consortium's model", "own": "its own model",
        RAW_PIXELS: "its own raw-pixel ensemble"}


def short_class(scores: dict) -> str:
    """"the split holds 2 image(s) of class '1' (fewer than 5)" when the scores' val split
    (`val_class_counts`) holds fewer than `MIN_VAL_PER_CLASS` images of some class (the
    scarcest named, and how many classes are short); "" otherwise, or when the scores predate
    the counts."""
    counts = scores.get("val_class_counts")
    if not isinstance(counts, dict):
        return ""
    short = sorted((int(n), str(c)) for c, n in counts.items() if int(n) < MIN_VAL_PER_CLASS)
    if not short:
        return ""
    n, c = short[0]
    more = f"; {len(short)} classes short" if len(short) > 1 else ""
    return f"the split holds {n} image(s) of class {c!r} (fewer than {MIN_VAL_PER_CLASS}{more})"


def choose(policy: str, scores: dict) -> tuple[str, str]:
    """(kept candidate, why) under `policy`, judged by `SELECT_BY` (records without it: accuracy).
    `scores` holds "own" and "consortium" and, where it was scored, "raw-pixels", each other
    candidate with its "se" beside the consortium's (`score_candidates`; none: 0), and, where
    scored, "val_class_counts". Under `best`: the consortium's model when the split holds fewer
    than `MIN_VAL_PER_CLASS` images of some class; else the one-standard-error rule: the
    consortium's model is kept unless another candidate scores more than one SE above it; if
    one does, the highest-scoring of the others, ties in `CANDIDATES` order."""
    names = [c for c in CANDIDATES if isinstance(scores.get(c), dict)]
    by = SELECT_BY if all(SELECT_BY in scores[c] for c in names) else "accuracy"
    val = {c: scores[c][by] for c in names}
    se = {c: float(scores[c].get("se", 0.0)) if by == SELECT_BY else 0.0 for c in names if c != "consortium"}
    where = f"({by.replace('_', ' ')}) on its {scores['scored_on']} data"
    if "warning" in scores:
        where += f" — WARNING: {scores['warning']}"
    if policy == "consortium":
        return "consortium", f"policy consortium (consortium {val['consortium']:.3f}, own {val['own']:.3f} {where})"
    short = short_class(scores)
    if short:
        others = ", ".join(f"{x.replace('-', ' ')} {val[x]:.3f}" for x in names if x != "consortium")
        return "consortium", (f"the consortium's model scores {val['consortium']:.3f} ({others}) {where}, but {short}: "
                              f"too few to rank the candidates, keeps the consortium's model")

    def vs(c: str) -> str:  # "own 0.750 (+0.227, SE 0.180)"
        return f"{c.replace('-', ' ')} {val[c]:.3f} ({val[c] - val['consortium']:+.3f}, SE {se[c]:.3f})"

    beat = [c for c in se if val[c] - val["consortium"] > se[c]]
    has_se = any(se.values())
    raw = f" and its raw-pixel ensemble {val[RAW_PIXELS]:.3f}" if RAW_PIXELS in val else ""
    if not beat and has_se:
        return "consortium", (f"the consortium's model scores {val['consortium']:.3f}; none beats it by more than "
                              f"one SE ({', '.join(vs(c) for c in se)}) {where}")
    if not beat:
        return "consortium", f"the consortium's model scores {val['consortium']:.3f} >= its own {val['own']:.3f}{raw} {where}"
    kept = max(se, key=lambda c: (val[c], -names.index(c)))
    rule = f" (one-SE rule: {', '.join(vs(c) for c in beat)})" if has_se else ""
    if kept == "own":
        raw = f" (>= its raw-pixel ensemble {val[RAW_PIXELS]:.3f})" if RAW_PIXELS in val else ""
        return kept, (f"its own model scores {val['own']:.3f} > the consortium's {val['consortium']:.3f}{raw} {where}; "
                      f"keeps its own{rule}")
    return kept, (f"its raw-pixel ensemble scores {val[RAW_PIXELS]:.3f} > the consortium's {val['consortium']:.3f} "
                  f"and its own model {val['own']:.3f} {where}; uses the raw-pixel ensemble (no learned model beat "
                  f"it){rule}")


def use_of(home: NodeHome, record: ModelRecord) -> dict:
    """What the model card says of `record`'s use: {"status": "in use" | "not kept" |
    "not in use", "why": one line, "in_use": the id of the model in use}."""
    use = model_in_use(home)
    if record.id == use.record.id:
        return {"status": "in use", "why": use.why, "in_use": use.record.id}
    prov = record.provenance
    if prov.get("kept") in ("own", RAW_PIXELS):
        kept = prov["kept"]
        other = (prov.get("candidates") or {}).get(kept, {}).get("model")
        return {"status": "not kept", "in_use": use.record.id,
                "why": f"the node kept {WHAT[kept]} {other} "
                       f"(policy {prov.get('keep_policy', DEFAULT_KEEP)}): {prov.get('kept_why')}"}
    return {"status": "not in use", "in_use": use.record.id,
            "why": f"the node uses {use.record.id} ({use.why})"}


def kept_details(home: NodeHome, model_id: str | None) -> dict:
    """The keep fields of a registered aggregate (for `atd aggregate`'s output)."""
    if not model_id:
        return {}
    prov = ModelRegistry.of(home).get(model_id).provenance
    return {k: prov[k] for k in ("candidates", "kept", "kept_why", "keep_policy", "warning") if k in prov}
