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

A round aggregate verifies only if
- its inputs are `weights` entries of its campaign and round, one per author, each trained
  from the aggregate's `reference` (the body's `start`: an input made from another model,
  e.g. pre-recorded before the previous round closed, is not an input of this round);
- its `participants` are exactly its inputs' authors and, with `missing`, they account for
  every active member (but those admitted after it, by lamport);
- its `reference` is the global model the verifier holds for the previous round (the
  runner passes it; round 0: the campaign's initial model);
- its rule (aggregator, q, f: `round_rule`) is the campaign's (the runner checks it) and
  the recomputed weights and global blob are the recorded ones.
The runner adds: an aggregate whose input entries or blobs do not arrive within the
round's deadline is not adopted.

Which verified aggregate a member adopts (nobody can stall or narrow a round):
1. Wait. After publishing its input a member waits for the input of every live member
   (every active member but one disconnected from its daemon for the grace period, or one
   that signed an input of a later round: it resumed past this one, `moved_past`;
   `--min-peers` shortens it on request) until the round's deadline. An aggregate that
   appears meanwhile does not end the wait, so a fast member cannot hurry it.
2. Narrowing. Let H be the authors of the valid inputs (this round, trained from the
   reference, blob held) the member holds when its wait ends, its own included. An
   aggregate that names a member of H as `missing` is not adopted (`narrows`); among the
   others the first that verifies in `candidate_order` (final, larger input set, hash of
   the inputs) is. If none does, the member records the aggregate over every valid input
   it holds -- at once when it is the coordinator (smallest publisher; one disconnected
   from the member's daemon for the grace period is passed over, so a coordinator that
   crashed before its aggregate left it does not hold the round up) or some aggregate
   narrowed, else after waiting one more deadline for the coordinator's. So an aggregate
   leaving out an input that reached honest members in time is answered by the full one,
   and being larger it also comes first for every member that holds both.
3. Closing. A round is over on an aggregate once it is `closed`: final, and a majority of
   its participants published next-round inputs trained from it. A closed aggregate is
   adopted whatever H says: a late member adopts it without training the round, and a
   member whose adopted global of round t-1 differs from a closed one switches to it and
   redoes round t (`RoundRunner.run_round`). Honest members only train from aggregates
   they may adopt, so one member cannot close a round alone, and a member that missed an
   aggregate comes back to the one the others moved on with.
How two honest members with different views converge: if every honest input reaches
every honest member before its deadline, they hold the same H, refuse the same narrow
aggregates and adopt the same first candidate (equal input sets give one global, bit for
bit, whoever signed). If an input reaches one member in time and another too late, the
first records the larger aggregate, the second may have adopted the smaller one: the
second switches to the larger one when it re-reads round t at the start of round t+1
(it comes first in `candidate_order` and narrows nothing the second held), or, if it
already moved on, both end on whichever aggregate closes (rule 3). Limit: with no
aggregate of the round ever closing (members split evenly and none reaching a majority
of some aggregate's participants) the split persists; a longer deadline makes the
boundary case rarer. Another: a member that (re)starts `atd rounds` resumes one past the
last round with a final aggregate (`current_round`), so a final aggregate recorded before
it started counts for it even if it narrows it out; members running the campaign are
covered by rules 1-3.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
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
from protocols.robust import pairwise_sq_distances
from protocols.rounds import RoundInputs, aggregator, candidate_order, canonical, is_final, last_layer_vector


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


def campaign_id(init: str, weighting: str, q: float, name: str, byzantine: int | None = None) -> str:
    """`weighting`: the aggregator's name; `byzantine`: a robust aggregator's f (None for the
    weighted means, whose campaign ids predate it)."""
    spec = {"init": init, "weighting": weighting, "q": float(q), "name": name}
    if byzantine is not None:
        spec["byzantine"] = int(byzantine)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def round_rule(body: dict) -> tuple[str, float, int]:
    """(aggregator, q, f) a round aggregate was computed with. An entry without `aggregator`
    (recorded before robust aggregators existed) is the weighted mean named by `weighting`."""
    name = body.get("aggregator", body.get("weighting"))
    q, f = body.get("q", 1.0), body.get("byzantine", 1)
    if not isinstance(name, str) or isinstance(q, bool) or not isinstance(q, (int, float)) \
            or isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < 1 << 16:
        raise RoundsError(f"round aggregate names no valid rule: aggregator {name!r}, q {q!r}, byzantine {f!r}")
    return name, float(q), f


def weights_round_body(store: BlobStore, blob: str, record: ModelRecord, *, campaign: str, rnd: int,
                       start: str) -> dict:
    """`start`: the global model the input was trained from (the round's reference)."""
    return {**weights_body(store, blob, part="full", record=record), "campaign": campaign, "round": int(rnd),
            "start": start}


def aggregate_round_body(*, campaign: str, rnd: int, weighting: str, q: float, reference: str, inputs: list[str],
                         weights: list[float], participants: list[str], missing: list[str], store: BlobStore,
                         blob: str, model: dict, cosines: list[float] | None = None, byzantine: int = 1) -> dict:
    """`weighting`: the aggregator's name, also recorded as `aggregator` (with `byzantine`,
    its f, for the robust ones)."""
    robust = aggregator(weighting).robust
    return {"mode": "round", "campaign": campaign, "round": int(rnd), "weighting": weighting, "q": float(q),
            "aggregator": weighting, **({"byzantine": int(byzantine)} if robust else {}),
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


def moved_past(led: Ledger, campaign: str, rnd: int) -> set[str]:
    """Members that published an input of a later round of `campaign` than `rnd` (the signers
    of those entries, whatever their bodies say; a body that does not fit the spec counts
    for none): they resumed past round `rnd` and will not publish its input."""
    return {signer(e) for e in led.query(kind="weights")
            if fits(e) and e.body.get("campaign") == campaign and type(r := e.body.get("round")) is int and r > rnd}


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


def closed(led: Ledger, entry: Entry) -> bool:
    """The round is over on this aggregate: it is final and a majority of its participants
    published inputs of the next round trained from its global model (they adopted it and
    moved on; one member alone cannot close a round). See the module doc."""
    b = entry.body
    blob, rnd, participants = b.get("blob"), b.get("round"), b.get("participants")
    if not final(led, entry) or type(rnd) is not int or not isinstance(participants, list) or not participants:
        return False
    moved = {signer(e) for e in led.query(kind="weights")
             if e.body.get("campaign") == b.get("campaign") and e.body.get("round") == rnd + 1
             and e.body.get("start") == blob}
    return 2 * len(moved & {p for p in participants if isinstance(p, str)}) > len(set(participants))


def narrows(entry: Entry, held: set[str]) -> list[str]:
    """The members of `held` (authors whose valid inputs this node held when its wait for
    the round ended) that a round aggregate names as `missing`: if any, it is not adopted here
    (unless `closed`)."""
    missing = entry.body.get("missing")
    return sorted(held & {m for m in missing if isinstance(m, str)}) if isinstance(missing, list) else []


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
                  reference: str, byzantine: int = 1) -> tuple[list[float], tuple[dict, dict]]:
    """Weights and (tensors, metadata) of a round's global model over `inputs` (already
    canonically ordered) by aggregator `weighting` (`protocols.rounds.AGGREGATORS`; f =
    `byzantine` for the robust ones): a weighted mean over the inputs with non-zero weight,
    or the aggregator's coordinate-wise rule over all of them."""
    blobs = [str(e.body.get("blob")) for e in inputs]
    names = [f"entry {e.id.hex()[:12]}" for e in inputs]
    for b in blobs + [reference]:
        if not store.has(b):
            raise RoundsError(f"blob {b[:12]} is not held here (fetch it first)")
    try:
        rule = aggregator(weighting)
        x = RoundInputs(n=len(blobs), q=q, f=byzantine,
                        reference=lambda: last_layer_vector(load_weights(store, reference)[0]),
                        layers=lambda: [last_layer_vector(load_weights(store, b)[0]) for b in blobs],
                        distances=lambda: model_distances(store, blobs, names))
        weights = [float(w) for w in rule.weights(x)]
    except AggregationError as exc:
        raise RoundsError(f"{weighting} weights: {exc}") from None
    if rule.combine is not None:
        tensors = combine_blobs(store, blobs, lambda v: rule.combine(v, byzantine), names=names)
    else:  # inputs with weight 0 (Krum's rejects) are not read: the mean over the others is the same
        kept = [i for i, w in enumerate(weights) if w != 0.0]
        tensors = average_blobs(store, [blobs[i] for i in kept], [weights[i] for i in kept],
                                names=[names[i] for i in kept], head=True)
    return weights, (tensors, result_meta(store, blobs[0], part="full", mode="round", weighting=weighting))


def _load_checked(store: BlobStore, blobs: list[str], names: list[str]) -> list[dict[str, torch.Tensor]]:
    """Every input's tensors (blob hashes verified), all with the first input's keys."""
    out = []
    for b, name in zip(blobs, names):
        try:
            store.verify(b)
        except AtdError as exc:
            raise AggregateError(f"{name}: {exc}") from None
        out.append(load_weights(store, b)[0])
    for t, name in zip(out, names):
        if t.keys() != out[0].keys():
            raise AggregationError(f"{name} does not have the tensors of {names[0]}")
    return out


def model_distances(store: BlobStore, blobs: list[str], names: list[str]) -> np.ndarray:
    """Krum's n x n squared distances between whole models (`protocols.robust`)."""
    sets = _load_checked(store, blobs, names)
    keys = sorted(sets[0])
    return pairwise_sq_distances([[t[k] for k in keys] for t in sets])


def combine_blobs(store: BlobStore, blobs: list[str], combine, *, names: list[str]) -> dict[str, torch.Tensor]:
    """A coordinate-wise rule applied tensor by tensor over held blobs (hashes verified first)."""
    try:
        sets = _load_checked(store, blobs, names)
        return {k: combine([t[k] for t in sets]) for k in sorted(sets[0])}
    except AggregationError as exc:
        raise AggregateError(str(exc)) from None


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
        name, q, f = round_rule(b)
        weights, (tensors, meta) = compute_round(store, inputs, weighting=name, q=q, reference=str(b.get("reference")),
                                                 byzantine=f)
    except RoundsError as exc:
        raise AggregateError(str(exc)) from None
    check_recorded_weights(entry, weights)
    if "cosines" in b:
        try:
            check_recorded_cosines(entry, round_cosines(store, inputs, str(b.get("reference"))))
        except RoundsError as exc:
            raise AggregateError(str(exc)) from None
    return check_result(store, entry, tensors, meta)
