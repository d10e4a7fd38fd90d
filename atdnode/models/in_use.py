"""Which model the node uses: the one answer to it, read from the registry's records.

An aggregate's record says what the node's keep decision kept (`provenance["kept"]`,
`["candidates"]`, `["kept_why"]`: written by `atdnode.aggregation.keep`); from that alone
`model_in_use` names the model `atd classify` and `atd predict` use without `--model`, the
dashboard's badge, `atd models`' mark and the model card.
"""
from __future__ import annotations

from dataclasses import dataclass

from atdnode.errors import AtdError
from atdnode.models.registry import ModelRecord, ModelRegistry
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
    model (AtdError when the registry is empty)."""
    reg = ModelRegistry.of(home)
    rec = reg.get("latest")
    prov = rec.provenance
    if prov.get("kept") == "own":
        own = (prov.get("candidates") or {}).get("own", {}).get("model")
        if isinstance(own, str):
            try:
                return InUse(reg.get(own), f"kept over the consortium's model {rec.id}: {prov.get('kept_why')}", rec)
            except AtdError:
                return InUse(rec, f"the newest model (the own model {own} it kept is no longer registered)")
    if prov.get("kept") == "consortium":
        return InUse(rec, f"the newest model, kept: {prov.get('kept_why')}")
    return InUse(rec, "the newest model")


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
