"""Horizontal VGS-ATD on a node (paper §3.1, Eq. 2-8): one-time averaging, then the ensemble.

`aggregate_horizontal` averages compatible published weight sets once (uniform weights by
default, Eq. 2; `samples`, `sqrt-classes`, `fedwavg` are options) — heads too when every
input is a full set over the same ordered label list. Then, by default (`classifier=
"ensemble"`, as in the paper and its Table 5 ablation), the fused extractor's CLS
features of the node's own data, plus the features peers sealed to it with the same fused
extractor (`atd share-features`), train the PCA -> MLP + RF + SVM soft-vote ensemble
(`atdnode.aggregation.ensemble`). `classifier="head"` keeps the averaged-head model (or the fused
extractor with the node's own head) and predicts with it directly.

The `aggregate` entry (mode horizontal) names inputs, weighting, weights, result blob,
`classifier`, the `ensemble` record when one was fitted, and for FedWAvg the `reference`
blob; `atdnode.aggregation.verify` recomputes the average from it.
"""
from __future__ import annotations

from atdnode import bodies
from atdnode.aggregation.aggregate import (
    AggregateError,
    AggregateResult,
    average_entries,
    blob_fields,
    extractor_of,
    base_warning,
    common_base,
    fedwavg_reference,
    heads_averaged,
    input_weights,
    opened,
    own_model,
    register_global,
    screen_inputs,
    select_inputs,
)
from atdnode.aggregation.candidates import judge_with
from atdnode.aggregation.features_share import data_spec_of
from atdnode.node import NodeHome
from atdnode.learning import ModelConfig
from atdnode.aggregation.ensemble import CLASSIFIERS, EnsembleOptions, fit_node_ensemble


def _spec_or_none(base, data_spec: str | None) -> str | None:
    from atdnode.aggregation.features_share import FeaturesError

    try:
        return data_spec_of(base, data_spec)
    except FeaturesError:
        return None


def aggregate_horizontal(home: NodeHome, *, weighting: str = "uniform", inputs: list[str] | None = None,
                         q: float = 1.0, classifier: str = "ensemble", data_spec: str | None = None,
                         features: list[str] | None = None, options: EnsembleOptions = EnsembleOptions(),
                         judge: bool = True) -> AggregateResult:
    """Average compatible published weight sets; fit the ensemble (unless `classifier="head"`);
    record an `aggregate` entry; register the global model; with `judge`, score it against
    the node's own on its validation data (`atdnode.aggregation.keep`)."""
    if classifier not in CLASSIFIERS:
        raise AggregateError(f"classifier must be one of {', '.join(CLASSIFIERS)}, got {classifier!r}")
    with opened(home) as (ident, store, led):
        base = own_model(home)
        spec = data_spec_of(base, data_spec) if classifier == "ensemble" else None
        judge_on = (spec or _spec_or_none(base, data_spec)) if judge else None
        skipped: list[dict] = []  # default inputs it cannot use, and why
        chosen = select_inputs(home, led, store, ids=inputs, skipped=skipped)
        if inputs is None:
            chosen = screen_inputs(store, chosen, skipped)
            if not chosen:
                raise AggregateError("no usable published weight sets: "
                                     + "; ".join(f"{s['entry'][:12]}: {s['why']}" for s in skipped)[:500])
        head = heads_averaged(chosen)
        reference = fedwavg_reference(store, base, weighting)
        weights = input_weights(store, chosen, weighting, q=q, head=head, reference=reference)
        blob, part = average_entries(store, chosen, weights, head=head, mode="horizontal", weighting=weighting)
        fit = None
        if classifier == "ensemble":
            fit = fit_node_ensemble(home, ident, store, led, cfg=ModelConfig.from_dict(base.model),
                                    extractor=extractor_of(store, blob, part), data_spec=str(spec),
                                    features=features, options=options)
        ids = [e.id.hex() for e in chosen]
        body = {"mode": "horizontal", "weighting": weighting, "q": float(q), "weights": weights, "inputs": ids,
                "head": head, "part": part, **blob_fields(store, blob), "model": chosen[0].body.get("model"),
                "classifier": classifier}
        if reference:
            body["reference"] = reference
        if skipped:
            body["skipped"] = skipped
        if fit is not None:
            body["ensemble"] = fit.record(store)
        if common_base(chosen):
            body["base"] = common_base(chosen)
        warning = base_warning(chosen)
        entry = bodies.append(led, ident.signer, "aggregate", body)
    extra, prov, details = {}, {}, {}
    if fit is not None:
        extra = {"ensemble": fit.blob}
        prov = {"data": spec, "ensemble_classes": fit.classes, "features": fit.features}
        details = {"ensemble": fit.blob, "classes": fit.classes, "features": fit.features, "skipped": fit.skipped,
                   "samples": fit.samples}
    model_id = register_global(home, store, base=base, blob=blob, part=part, entry=entry, kind="global-horizontal",
                               extra_blobs=extra, extra_provenance=prov,
                               judge=judge_with(home, store, judge_on, options) if judge_on else None)
    if warning:
        details["warnings"] = [warning]
    from atdnode.aggregation.keep import kept_details

    details.update(kept_details(home, model_id))
    if skipped:
        details["skipped_inputs"] = skipped
    return AggregateResult(entry=entry, blob=blob, weights=weights, inputs=ids, model_id=model_id, head=head,
                           details=details)
