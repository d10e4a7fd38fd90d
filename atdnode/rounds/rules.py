"""What counts as a round of `atd rounds` in the ledger, and how any member checks it.

Split from `atdnode.rounds.runner` (the loop) so the rules stand on their own: what fixes a
campaign (`init_blob`, `campaign_id`), the entry bodies a round writes
(`weights_round_body`, `aggregate_round_body`), the inputs of a round, its candidate
aggregates in the order they are tried (`protocols.rounds`), where a restarted node
resumes, and `verify_round`, the recomputation every member runs before it adopts a
round's global model (also `atd aggregate --verify`).

A *campaign* is fixed by its shared initial model and rule: every member builds the round-0
model deterministically (`torch.manual_seed(seed)` on the same config and label space ->
the same blob hash everywhere) and the campaign id is a hash of (init blob, weighting, q,
name). Entries (typed in atdnode.bodies):

weights    the usual `weights` body of a full set + campaign, round, start (the global
           model it was trained from)
aggregate  mode "round": campaign, round, weighting, q, reference (previous global blob;
           round 0: the init blob), inputs (canonically sorted weights entry ids),
           weights, participants / missing (peer ids), blob (the global model)

Rounds no single member can steer: a round aggregate verifies only if
- its inputs are `weights` entries of its campaign and round, one per author, each trained
  from the aggregate's `reference` (the body's `start`: an input made from another model,
  e.g. pre-recorded before the previous round closed, is not an input of this round);
- its `participants` are exactly its inputs' authors and, with `missing`, they account for
  every active member (but those admitted after it, by lamport);
- its `reference` is the global model the verifier holds for the previous round (the
  runner passes it; round 0: the campaign's initial model);
- the recomputed weights and global blob are the recorded ones.
The runner adds: an aggregate whose input entries or blobs do not arrive within the
round's deadline is not adopted; a final aggregate (majority of members) is what a late
member adopts; otherwise one that covers every input the member holds.
"""
from __future__ import annotations

import hashlib
import json

import torch

from atdnode.aggregation import (AggregateError, average_blobs, check_recorded_cosines, check_recorded_weights,
                                 check_result, result_meta)
from atdnode.blobs import BlobStore
from atdnode.bodies import BodyError, body_of, fits
from atdnode.data import load_dataset
from atdnode.data import require_classes
from atdnode.errors import AtdError
from atdnode.learning import ModelConfig, build_model, export_part
from atdnode.models import ModelRecord, load_weights, weights_body
from ledger import Entry, Ledger
from ledger.keys import peer_id_from_public_key
from protocols.aggregation import AggregationError
from protocols.fedwavg import fedwavg_cosines
from protocols.rounds import candidate_order, canonical, is_final, last_layer_vector, round_weights


class RoundsError(AtdError):
    """A round cannot run (bad config, no inputs) or a round aggregate does not verify."""


def signer(e: Entry) -> str:
    return peer_id_from_public_key(e.author)


# ---------------------------------------------------------------- campaign and bodies

def init_blob(store: BlobStore, cfg: ModelConfig, data_spec: str, seed: int,
              state: dict[str, torch.Tensor] | None = None) -> tuple[str, ModelConfig, list[str], str]:
    """The shared round-0 model: same config, labels and seed (and `state`, when the campaign
    starts from given weights, e.g. netsim's next phase) -> same blob hash on every member."""
    data = load_dataset(data_spec, cfg.img_size, cfg.in_chans, "train")
    require_classes(data)
    cfg = cfg.with_classes(len(data.classes))
    torch.manual_seed(seed)
    model = build_model(cfg)
    if state is not None:
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise RoundsError(f"initial state does not fit the model: {str(exc).splitlines()[0]}") from None
    blob = export_part(store, model, cfg, "full", labels=data.classes, label_fp=data.label_fp, samples=0,
                       extra={"rounds_init_seed": seed})
    return blob, cfg, list(data.classes), data.label_fp


def campaign_id(init: str, weighting: str, q: float, name: str) -> str:
    raw = json.dumps({"init": init, "weighting": weighting, "q": float(q), "name": name}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def weights_round_body(store: BlobStore, blob: str, record: ModelRecord, *, campaign: str, rnd: int,
                       start: str) -> dict:
    """`start`: the global model the input was trained from (the round's reference)."""
    return {**weights_body(store, blob, part="full", record=record), "campaign": campaign, "round": int(rnd),
            "start": start}


def aggregate_round_body(*, campaign: str, rnd: int, weighting: str, q: float, reference: str, inputs: list[str],
                         weights: list[float], participants: list[str], missing: list[str], store: BlobStore,
                         blob: str, model: dict, cosines: list[float] | None = None) -> dict:
    return {"mode": "round", "campaign": campaign, "round": int(rnd), "weighting": weighting, "q": float(q),
            "reference": reference, "inputs": inputs, "weights": weights, "participants": participants,
            "missing": missing, "head": True, "part": "full", "blob": blob, "size": store.size(blob),
            "manifest": store.manifest(blob).hash, "model": model,
            **({"cosines": cosines} if cosines is not None else {})}


def round_cosines(store: BlobStore, inputs: list[Entry], reference: str) -> list[float]:
    """FedWAvg Eq. 3's c_i of each input's last layer against the reference's, input order
    (what a fedwavg round's `aggregate` entry records beside its weights, as `cosines`)."""
    try:
        ref = last_layer_vector(load_weights(store, reference)[0])
        return [float(c) for c in fedwavg_cosines(ref, [last_layer_vector(load_weights(store, str(e.body.get("blob")))[0])
                                                        for e in inputs])]
    except AggregationError as exc:
        raise RoundsError(f"fedwavg cosines: {exc}") from None


# ---------------------------------------------------------------- a round in the ledger


def round_weights_entries(led: Ledger, campaign: str, rnd: int, start: str | None = None) -> list[Entry]:
    """Weights entries of round `rnd`, one per author (its first), canonically ordered;
    with `start`, only those trained from it (the round's global model)."""
    by_author: dict[str, Entry] = {}
    for e in led.query(kind="weights"):
        b = e.body
        if fits(e) and b.get("campaign") == campaign and b.get("round") == rnd and (start is None or b.get("start") == start):
            a = signer(e)
            if a not in by_author or e.id.hex() < by_author[a].id.hex():
                by_author[a] = e
    return sorted(by_author.values(), key=lambda e: e.id.hex())


def round_candidates(led: Ledger, campaign: str, rnd: int) -> list[Entry]:
    """Round `rnd`'s aggregate entries in the order they are tried (`candidate_order`);
    an entry whose body does not fit the spec (`atdnode.bodies`) is none."""
    cands = [e for e in led.query(kind="aggregate")
             if fits(e) and e.body.get("mode") == "round" and e.body.get("campaign") == campaign and e.body.get("round") == rnd]
    members = len(active_members(led))
    order = candidate_order([([str(h) for h in e.body.get("inputs") or []], e.id.hex()) for e in cands], members)
    return [cands[i] for i in order]


def round_aggregate(led: Ledger, campaign: str, rnd: int) -> Entry | None:
    """Round `rnd`'s first candidate aggregate (not yet verified), or None."""
    cands = round_candidates(led, campaign, rnd)
    return cands[0] if cands else None


def final(led: Ledger, entry: Entry) -> bool:
    """Inputs from a majority of the active members (protocols.rounds.is_final); False for
    an entry whose body does not fit the spec."""
    return fits(entry) and is_final(len(set(entry.body.get("inputs") or [])), len(active_members(led)))


def current_round(led: Ledger, campaign: str) -> int:
    """One past the last round with a final aggregate (a restarted node resumes here; a
    round one member recorded alone does not move it on)."""
    rounds = {e.body.get("round") for e in led.query(kind="aggregate")
              if fits(e) and e.body.get("mode") == "round" and e.body.get("campaign") == campaign and final(led, e)}
    r = 0
    while r in rounds:
        r += 1
    return r


def active_members(led: Ledger) -> list[str]:
    m = led.membership()
    return sorted(peer_id_from_public_key(k) for k, s in m.members.items() if not s.revoked and m.current(k) == k)


def compute_round(store: BlobStore, inputs: list[Entry], *, weighting: str, q: float,
                  reference: str) -> tuple[list[float], tuple[dict, dict]]:
    """Weights and (tensors, metadata) of a round's global model over `inputs` (already
    canonically ordered)."""
    blobs = [str(e.body.get("blob")) for e in inputs]
    for b in blobs + [reference]:
        if not store.has(b):
            raise RoundsError(f"blob {b[:12]} is not held here (fetch it first)")
    try:
        ref_vec = last_layer_vector(load_weights(store, reference)[0]) if weighting == "fedwavg" else None
        layers = [last_layer_vector(load_weights(store, b)[0]) for b in blobs]
        weights = [float(x) for x in round_weights(weighting, reference=ref_vec, layers=layers, q=q)]
    except AggregationError as exc:
        raise RoundsError(f"{weighting} weights: {exc}") from None
    tensors = average_blobs(store, blobs, weights, names=[f"entry {e.id.hex()[:12]}" for e in inputs], head=True)
    return weights, (tensors, result_meta(store, blobs[0], part="full", mode="round", weighting=weighting))


def absent_inputs(led: Ledger, entry: Entry) -> list[str]:
    """The input ids of a round aggregate that are not (yet) in this ledger (AggregateError
    for an entry whose body does not fit the spec)."""
    return [h for h in _body(entry).get("inputs") or [] if led.get(h) is None]


def round_inputs(led: Ledger, entry: Entry, reference: str | None = None) -> list[Entry]:
    """A round aggregate's input entries, after every check that needs no blob (module doc);
    AggregateError names the first that fails."""
    b, eid = _body(entry), entry.id.hex()[:16]
    ids = b.get("inputs") or []
    if not ids or not all(isinstance(h, str) and len(h) == 64 for h in ids) or ids != canonical(ids):
        raise AggregateError(f"aggregate {eid} does not verify: inputs are not canonically ordered")
    if reference is not None and b.get("reference") != reference:
        raise AggregateError(f"aggregate {eid} does not verify: its reference {str(b.get('reference'))[:12]} is "
                             f"not the previous round's global model {reference[:12]}")
    inputs = []
    for h in ids:
        e = led.get(h)
        if e is None:
            raise AggregateError(f"aggregate {eid}: input {h[:16]} is not in this ledger (yet)")
        if e.kind != "weights" or e.body.get("campaign") != b.get("campaign") or e.body.get("round") != b.get("round"):
            raise AggregateError(f"aggregate {eid}: input {h[:16]} is not a weights entry of its round")
        if e.body.get("start") != b.get("reference"):
            raise AggregateError(f"aggregate {eid}: input {h[:16]} was not trained from the round's reference")
        inputs.append(e)
    authors = [signer(e) for e in inputs]
    if len(set(authors)) != len(authors):
        raise AggregateError(f"aggregate {eid} does not verify: two of its inputs have one author")
    participants, missing = b.get("participants"), b.get("missing") or []
    if participants != sorted(authors):
        raise AggregateError(f"aggregate {eid} does not verify: its participants are not its inputs' authors")
    later = {peer_id_from_public_key(m.body["member"]) for m in led.query(kind="member")  # joined after it
             if m.body.get("action") == "admit" and isinstance(m.body.get("member"), bytes) and m.lamport > entry.lamport}
    unaccounted = set(active_members(led)) - set(authors) - set(missing) - later
    if unaccounted or set(missing) & set(authors):
        raise AggregateError(f"aggregate {eid} does not verify: it neither includes nor names as missing "
                             f"{', '.join(sorted(p[:12] for p in unaccounted)) or 'its own participants'}")
    return inputs


def _body(entry: Entry) -> dict:
    """The body of an aggregate, checked against the spec (AggregateError if it does not fit)."""
    try:
        return body_of(entry)
    except BodyError as exc:
        raise AggregateError(f"aggregate does not verify: {exc}") from None


def verify_round(led: Ledger, store: BlobStore, entry: Entry, reference: str | None = None) -> str:
    """Recompute a `round` aggregate from its inputs and reference; returns the result hash.
    `reference`: the global model the verifier holds for the previous round (checked when
    given; `atd aggregate --verify` has none to give)."""
    b = entry.body
    inputs = round_inputs(led, entry, reference)
    try:
        weights, (tensors, meta) = compute_round(store, inputs, weighting=str(b.get("weighting")),
                                                 q=float(b.get("q", 1.0)), reference=str(b.get("reference")))
    except RoundsError as exc:
        raise AggregateError(str(exc)) from None
    check_recorded_weights(entry, weights)
    if "cosines" in b:
        try:
            check_recorded_cosines(entry, round_cosines(store, inputs, str(b.get("reference"))))
        except RoundsError as exc:
            raise AggregateError(str(exc)) from None
    return check_result(store, entry, tensors, meta)
