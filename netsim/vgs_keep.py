"""Which model each VGS-ATD number scores when the nodes have a val split.

With `[scenario] val_fraction > 0` every node's .npz holds a held-out `val` split, so `atd
aggregate` judges its candidates — its own model and the consortium's — on it and the
node's `[aggregate] keep` policy (default best, `atdnode.aggregation.keep`) decides which model `atd
classify` uses by default (`atdnode.models.default_model`). The report then scores:

* per node (own test data; hence the report's forgetting): the model `atd classify` uses by
  default — its own where the node kept its own, its raw-pixel ensemble where that scored
  best on its val split, else the consortium's;
* overall (the phase's pooled test set): the consortium's model of every node, as without
  a val split (what the consortium learned, not what each node chose).

`score_kept` rewrites the per-node entries of the nodes that kept their own model, tags
every entry with the model it scored (`"model"`: "own" | "raw-pixels" | "consortium") and adds one
note per such node ("h1 keeps its own model: own 0.800 > consortium 0.710 on its val split ..."),
and one per node that kept the consortium's model although another candidate scored higher on
val, by no more than one SE of the difference (`atdnode.aggregation.keep`'s one-SE rule).
Without a val split (val_fraction 0) netsim does none of this: the nodes' data specs say
`val=train` (`netsim.nodedata.node_spec`), so no node makes a choice — none on its test data —
and every node takes the consortium's model.
"""
from __future__ import annotations

from atdnode.models import default_model, is_raw_pixels
from netsim.baselines import PhaseResult
from netsim.learn import global_probs, score_probs, to_global
from netsim.nodedata import ScenarioData
from netsim.vgs_ops import NodeOps


def score_kept(res: PhaseResult, data: ScenarioData, ops: dict[str, NodeOps], consortium: dict[str, str]) -> None:
    """For each node of `consortium` (node -> the consortium model netsim scored for it, in
    `res.per_node` and `res.overall`): re-score its per-node entry on the model `atd
    classify` uses by default when that is not the consortium's, tag each entry, note why."""
    kept_own = []
    for n, model_id in consortium.items():
        entry = res.per_node.get(n)
        if not isinstance(entry, dict) or "accuracy" not in entry:
            continue
        use = default_model(ops[n].home)
        if use.id == model_id:
            entry["model"] = "consortium"
            held = _within_se(ops[n], model_id)
            if held:
                res.notes.append(f"{n} keeps the consortium's model: {held}")
            continue
        nd = data.nodes[n]
        names, probs = ops[n].probabilities(use.id, nd.test.images)
        y_true = to_global(nd.test.labels.numpy(), nd.classes, data.label_space)
        kept = "raw-pixels" if is_raw_pixels(use) else "own"
        res.per_node[n] = {**score_probs(y_true, global_probs(probs, names, data.label_space)), "model": kept}
        what = "its raw-pixel ensemble" if kept != "own" else "its own model"
        res.notes.append(f"{n} keeps {what}: {_why(ops[n], model_id, kept)} — its per-node accuracy (and "
                         f"forgetting) scores {what} (what `atd classify` uses); overall scores the consortium's")
        kept_own.append(n)
    if consortium:
        rest = [n for n in consortium if n not in kept_own]
        res.notes.append("per-node accuracy: the model `atd classify` uses by default ([aggregate] keep, judged on "
                         f"each node's val split): its own (model or raw-pixel ensemble) for {', '.join(kept_own) or 'no node'}, the consortium's "
                         f"for {', '.join(rest) or 'no node'}; overall: every node's consortium model")


def _why(ops: NodeOps, model_id: str, kept: str = "own") -> str:
    """"own 0.800 > consortium 0.710 (one-SE rule: SE 0.040) (balanced accuracy) on its val split" from the aggregate's keep record
    (`kept`: the candidate kept, "own" or "raw-pixels")."""
    from atdnode.aggregation import SELECT_BY

    prov = ops.registry.get(model_id).provenance
    cand = prov.get("candidates") or {}
    by = SELECT_BY if SELECT_BY in (cand.get("own") or {}) else "accuracy"
    try:
        mine, cons = cand[kept][by], cand["consortium"][by]
    except (KeyError, TypeError):
        return str(prov.get("kept_why") or "its aggregate kept its own model")
    split = cand.get("scored_on", "?")
    others = "".join(f", {c} {cand[c][by]:.3f}" for c in ("own", "raw-pixels") if c != kept and c in cand)
    se = cand[kept].get("se")
    rule = f" (one-SE rule: SE {se:.3f})" if isinstance(se, (int, float)) and by == SELECT_BY else ""
    return f"{kept} {mine:.3f} > consortium {cons:.3f}{others}{rule} ({by.replace('_', ' ')}) {_where(split)}"


def _where(split: str) -> str:
    """"on its val split" / "on its test (no val split) data": the split the candidates were scored on."""
    return f"on its {split} " + ("split" if split == "val" else "data")


def _within_se(ops: NodeOps, model_id: str) -> str:
    """"raw-pixels 0.657 > consortium 0.586 by no more than one SE (0.090) (balanced accuracy) on its
    val split" (the split they were scored on) for the candidates that scored higher than the
    consortium's model the node kept
    (the one-SE rule, `atdnode.aggregation.keep.choose`); when the val split held too few images
    of a class to rank them, that instead ("the split holds 2 image(s) of class '0' (fewer than 5)
    on its val split, too few to rank the candidates"); "" when neither."""
    from atdnode.aggregation import SELECT_BY, short_class

    cand = ops.registry.get(model_id).provenance.get("candidates") or {}
    cons = (cand.get("consortium") or {}).get(SELECT_BY)
    short = short_class(cand)
    if short:  # the split could not rank them: say so, not "within one SE"
        return f"{short} {_where(cand.get('scored_on', '?'))}, too few to rank the candidates"
    higher = [f"{k} {cand[k][SELECT_BY]:.3f} > consortium {cons:.3f} by no more than one SE ({cand[k]['se']:.3f})"
              for k in ("own", "raw-pixels") if isinstance(cons, (int, float)) and isinstance(cand.get(k), dict)
              and "se" in cand[k] and cand[k].get(SELECT_BY, 0.0) > cons]
    return f"{', '.join(higher)} ({SELECT_BY.replace('_', ' ')}) {_where(cand.get('scored_on', '?'))}" if higher else ""
