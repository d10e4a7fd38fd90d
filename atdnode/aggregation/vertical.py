"""Vertical VGS-ATD on a node: fused extractor -> CLS features -> PCA -> MLP + RF + SVM soft vote.

`aggregate_vertical` runs the node's side of vertical mode:

1. fuse: a weighted average of the chosen published extractors (heads never take part),
   stored as a blob (bit-reproducible: nodes fusing the same inputs get the same hash);
2. CLS features of the node's own training data under the fused extractor (cached);
3. the features peers sealed to this node *with the same fused extractor* (`features`
   entries naming it; `atd share-features`): others are skipped, or refused when named;
4. one `protocols.ensemble.EnsembleClassifier` over the union of the label spaces, fitted
   on the parts in a canonical order (by sender peer id) — so nodes holding the same
   features fit the same classifier — and saved pickle-free (safetensors) as a blob;
5. a signed `aggregate` entry (mode vertical; `ensemble`: blob, classes, the features
   entries used, sample count) and a registry record whose `blobs["ensemble"]` makes
   `atd classify` predict with the ensemble.

The typical run is twice: fuse (own features only), `atd share-features` with the fused
model, then fuse again once peers' features arrived (same fused blob, richer ensemble).
The ensemble fitting (`atdnode.aggregation.ensemble`) is shared with horizontal and hierarchical mode.
"""
from __future__ import annotations

from atdnode import bodies
from atdnode.aggregation.aggregate import (
    AggregateResult,
    average_entries,
    blob_fields,
    base_warning,
    common_base,
    fedwavg_reference,
    input_weights,
    opened,
    own_model,
    register_global,
    select_inputs,
)
from atdnode.aggregation.candidates import judge_with
from atdnode.aggregation.features_share import data_spec_of
from atdnode.node import NodeHome
from atdnode.learning import ModelConfig
from atdnode.aggregation.ensemble import EnsembleOptions, fit_node_ensemble  # noqa: F401 (re-export)


def aggregate_vertical(home: NodeHome, *, weighting: str = "uniform", inputs: list[str] | None = None,
                       q: float = 1.0, data_spec: str | None = None, features: list[str] | None = None,
                       options: EnsembleOptions = EnsembleOptions(), judge: bool = True) -> AggregateResult:
    """Fuse published extractors, fit the ensemble, record an `aggregate` entry, register the
    model; with `judge`, score it against the node's own on its validation data (`atdnode.aggregation.keep`)."""
    with opened(home) as (ident, store, led):
        base = own_model(home)
        spec = data_spec_of(base, data_spec)
        chosen = select_inputs(home, led, store, ids=inputs, parts=("extractor", "full") if inputs else ("extractor",))
        reference = fedwavg_reference(store, base, weighting)
        weights = input_weights(store, chosen, weighting, q=q, head=False, reference=reference)
        blob, part = average_entries(store, chosen, weights, head=False, mode="vertical", weighting=weighting)
        fit = fit_node_ensemble(home, ident, store, led, cfg=ModelConfig.from_dict(base.model), extractor=blob,
                                data_spec=spec, features=features, options=options)
        ids = [e.id.hex() for e in chosen]
        body = {"mode": "vertical", "weighting": weighting, "q": float(q), "weights": weights, "inputs": ids,
                "head": False, "part": part, **blob_fields(store, blob), "model": base.model,
                "ensemble": fit.record(store), **({"reference": reference} if reference else {})}
        if common_base(chosen):
            body["base"] = common_base(chosen)
        warning = base_warning(chosen)
        entry = bodies.append(led, ident.signer, "aggregate", body)
    model_id = register_global(home, store, base=base, blob=blob, part=part, entry=entry, kind="global-vertical",
                               extra_blobs={"ensemble": fit.blob},
                               extra_provenance={"data": spec, "ensemble_classes": fit.classes,
                                                 "features": fit.features},
                               judge=judge_with(home, store, spec, options) if judge else None)
    details = {"ensemble": fit.blob, "classes": fit.classes, "features": fit.features, "skipped": fit.skipped,
               "samples": fit.samples, **({"warnings": [warning]} if warning else {})}
    from atdnode.aggregation.keep import kept_details

    details.update(kept_details(home, model_id))
    return AggregateResult(entry=entry, blob=blob, weights=weights, inputs=ids, model_id=model_id, head=False,
                           details=details)
