"""Which model the node uses: the one answer to it, read from the registry's records.

An aggregate's record says what the node's keep decision kept (`provenance["kept"]`,
`["candidates"]`, `["kept_why"]`: written by `atdnode.aggregation.keep`); from that alone
`model_in_use` names the model (a learned one, or the node's raw-pixel ensemble) `atd classify` and `atd predict` use without `--model`, the
dashboard's badge, `atd models`' mark and the model card.
"""
from __future__ import annotations

from dataclasses import dataclass

from atdnode.errors import AtdError
from atdnode.models.registry import ModelRecord, ModelRegistry, is_raw_pixels
from atdnode.node import NodeHome


@dataclass(frozen=True)
class InUse:
    """The model the node uses (`record`), why (one line), and the newest record when the
    keep decision rejected it (`not_kept`, else None)."""

    record: ModelRecord
    why: str
    not_kept: ModelRecord | None = None


def model_in_use(home: NodeHome) -> InUse:
    """The model `atd classify` / `atd predict` use without `--model`: the newest record, or,
    when the newest is an aggregate whose keep decision kept the node's own model, that own
    model, or its raw-pixel ensemble (AtdError when the registry is empty)."""
    reg = ModelRegistry.of(home)
    # a raw-pixel ensemble is in use only through the keep decision that kept it: one left
    # without its decision (a run killed between the two records) is never the newest model
    rec = next((r for r in reversed(reg.list()) if not is_raw_pixels(r)), None) or reg.get("latest")
    prov = rec.provenance
    kept = prov.get("kept")
    if kept in ("own", "raw-pixels"):  # its own model, or its own raw-pixel ensemble
        other = (prov.get("candidates") or {}).get(kept, {}).get("model")
        if isinstance(other, str):
            try:
                return InUse(reg.get(other), f"kept over the consortium's model {rec.id}: {prov.get('kept_why')}", rec)
            except AtdError:
                return InUse(rec, f"the newest model (the {kept} model {other} it kept is no longer registered)")
    if prov.get("kept") == "consortium":
        return InUse(rec, f"the newest model, kept: {prov.get('kept_why')}")
    return InUse(rec, "the newest model")


def learned_model_in_use(home: NodeHome) -> ModelRecord:
    """The learned model the node uses: `model_in_use`, or, where that is its raw-pixel
    ensemble, the own model the same keep decision judged beside it (the "own" candidate
    of the next decision)."""
    use = model_in_use(home)
    if not is_raw_pixels(use.record) or use.not_kept is None:
        return use.record
    own = (use.not_kept.provenance.get("candidates") or {}).get("own", {}).get("model")
    try:
        return ModelRegistry.of(home).get(own) if isinstance(own, str) else use.not_kept
    except AtdError:
        return use.not_kept


def default_model(home: NodeHome) -> ModelRecord:
    """`model_in_use(home).record`."""
    return model_in_use(home).record


def resolve_model(home: NodeHome, ref: str | None) -> ModelRecord:
    """A model named on a command line: an id or unique prefix, or `latest` / None for the
    model in use (`model_in_use`)."""
    return default_model(home) if ref in (None, "latest") else ModelRegistry.of(home).get(ref)


def chosen_on_test(record: ModelRecord) -> str | None:
    """The warning a record carries when a keep decision behind it was judged on test data."""
    return (record.provenance.get("candidates") or {}).get("warning") or record.provenance.get("warning")
