"""The bodies of ledger entries, typed in one place: every writer and reader goes through here.

Each kind has a `BodySpec`: the fields it must have and may have, each with its JSON/msgpack
type. `check_body` validates a body (writers call it through `append` before signing;
readers through `body_of` before using an entry), so a field name cannot drift between the
code that writes an entry and the code that reads it. Unknown extra fields are allowed
(a newer peer may add some); missing required fields and wrong types are a `BodyError`
naming the kind and the field. To add a kind, add its spec to `SPECS`.

Kinds (INTERFACES.md has the generated table of fields and types), and what the fields mean:

weights    a published weight set (`atd publish-weights`; split servers' bodies): blob, size,
           manifest (hash of the blob's chunk manifest), part (full | extractor | head |
           body), model (config dict), labels + label_fp (the label space), samples,
           metrics, provenance (entry ids it descends from), base (the shared start the
           model descends from: averaging different bases is meaningless), readers (only
           they may fetch the blob); a round's weights carry campaign, round and start
           (the global model they were trained from)
features   CLS features sealed to named peers (`atd share-features`): recipients (peer ids),
           shape [N, D], classes, label_fp, samples, model, extractor (blob of the model
           that made them), alg (the sealing)
aggregate  an aggregation (`atd aggregate`): mode (horizontal | vertical | group |
           hierarchical | round), weighting, q, weights (one per input), inputs (weights
           entries; group aggregates for hierarchical), head (heads averaged), part (full |
           extractor), the result blob; group: name, n_classes, n_models; hierarchical:
           groups [{name, entry, n_classes, n_models}]; horizontal: classifier (ensemble |
           head); with an ensemble: ensemble {blob, size, manifest, classes, features, samples,
           own_samples}; fedwavg: reference (blob the inputs were compared with); base (the
           inputs' common start); skipped [{entry, why}] (inputs left out); mode "round": one
           round of `atd rounds` (campaign, round, reference, participants, missing)
hello      a node's addresses, X25519 key, role, name (the daemon)
metrics    free-form measurements (netsim workloads)
service    a split-learning server's offer (`atd split serve`); nothing about the p-FESTA embedder
split_secret  a p-FESTA / MSD campaign's embedder secret (`atdnode.split.secret`): the patch
           projection + position embedding (p-FESTA §III-B, MSD §III: the server must not
           know them), made by one client and sealed to the other client members::

               {"service": hex id of the server's `service` entry (the campaign),
                "recipients": [peer ids, sorted; the author is one of them],
                "envelope": bytes (sealed safetensors of the embedder state,
                            `protocols.feature_crypto.seal_bytes`),
                "alg": protocols.feature_crypto.ALG}

           The envelope is ciphertext: the server replicates the entry, cannot open it.
plan       a signed plan the consortium carries out (`atd plan propose`, atdnode.plans): name,
           created (unix seconds; step deadlines count from it), late (proceed: after a step's
           deadline its dependants go on without the members that are late, recorded),
           members (peer ids taking part), steps [{id, kind, members, deadline, ...the kind's
           options}] from a fixed set of step kinds (atdnode.plans.spec.STEP_KINDS; never
           code), data names that each member maps to its own data in config.toml
plan_decision  a member's accept | decline of a plan (plan: hex id; reason); the first one counts
plan_step  a member's result of one step of a plan: plan, step (its id), status (done | failed),
           results (entry ids it made: weights, aggregate, features), reason (one line, failed),
           missing (peer ids left out after a deadline), model (local model id), metrics,
           started (unix time the step began here), seconds (how long it ran)
split_join a member's own, signed word that it joins a p-FESTA / MSD campaign
           ({"service": hex id of the `service` entry}); the campaign's secret is sealed
           to these members only, so the server cannot name anyone else.
split_accept  the campaign server's signed word (`atdnode.split.secret`): it accepts
           `clients` (peer ids) into the campaign ({"service": hex id, "clients": [...]});
           a join takes effect only once accepted. With "secret" (hex id of a `split_secret`
           entry) it adopts that secret and closes the client list: the campaign's secret
           is the one its server's chain names first, never one picked by lamport.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from atdnode.errors import AtdError
from ledger import Entry, Ledger, Signer


class BodyError(AtdError):
    """An entry body lacks a required field or has one of the wrong type."""


_NUM = (int, float)


@dataclass(frozen=True)
class BodySpec:
    required: Mapping[str, tuple[type, ...]]
    optional: Mapping[str, tuple[type, ...]]
    items: Mapping[str, tuple[type, ...]]  # element types of list fields (when checked)


def _spec(required: dict, optional: dict | None = None, items: dict | None = None) -> BodySpec:
    return BodySpec(required, optional or {}, items or {})


_BLOB = {"blob": (str,), "size": (int,), "manifest": (str,)}
SPECS: dict[str, BodySpec] = {
    "weights": _spec({**_BLOB, "part": (str,), "model": (dict,), "labels": (list,), "label_fp": (str,),
                      "samples": (int,), "metrics": (dict,), "provenance": (list,)},
                     {"model_id": (str,), "base": (str,), "algorithm": (str,), "tasks": (list,),
                      "authorized": (list,), "readers": (list,), "campaign": (str,), "round": (int,),
                      "start": (str,), "class_counts": (dict,), "data_fp": (str,)},
                     {"labels": (str,), "provenance": (str,)}),
    "features": _spec({**_BLOB, "recipients": (list,), "shape": (list,), "classes": (list,), "label_fp": (str,),
                       "samples": (int,), "model": (dict,), "extractor": (str,), "alg": (str,)},
                      {"model_id": (str,), "provenance": (list,)},
                      {"recipients": (str,), "shape": (int,), "classes": (str,)}),
    "aggregate": _spec({**_BLOB, "mode": (str,), "weighting": (str,), "weights": (list,), "inputs": (list,),
                        "head": (bool,), "part": (str,)},
                       {"model": (dict, type(None)), "q": _NUM, "groups": (list,), "ensemble": (dict,),
                        "classifier": (str,), "reference": (str,), "name": (str,), "n_classes": (int,),
                        "n_models": (int,), "skipped": (list,), "base": (str,),
                        "campaign": (str,), "round": (int,), "participants": (list,), "missing": (list,),
                        "cosines": (list,)},
                       {"weights": _NUM, "inputs": (str,), "groups": (dict,), "skipped": (dict,),
                        "participants": (str,), "missing": (str,), "cosines": _NUM}),
    "hello": _spec({"addrs": (list,), "x25519": (bytes,)}, {"role": (str,), "name": (str, type(None))},
                   {"addrs": (str,)}),
    "metrics": _spec({}),
    "service": _spec({"role": (str,), "protocol": (str,)}),
    "split_secret": _spec({"service": (str,), "recipients": (list,), "envelope": (bytes,), "alg": (str,)},
                          items={"recipients": (str,)}),
    "split_join": _spec({"service": (str,)}),
    "split_accept": _spec({"service": (str,), "clients": (list,)}, {"secret": (str,)}, {"clients": (str,)}),
    "plan": _spec({"name": (str,), "created": (int,), "late": (str,), "members": (list,), "steps": (list,)},
                  {"model": (dict,)}, {"members": (str,), "steps": (dict,)}),
    "plan_decision": _spec({"plan": (str,), "decision": (str,)}, {"reason": (str,)}),
    "plan_step": _spec({"plan": (str,), "step": (str,), "status": (str,), "results": (list,)},
                       {"reason": (str,), "missing": (list,), "model": (str,), "metrics": (dict,), "started": _NUM,
                        "seconds": _NUM},
                       {"results": (str,), "missing": (str,)}),
}
PLAN_KIND, PLAN_DECISION_KIND, PLAN_STEP_KIND = "plan", "plan_decision", "plan_step"
SPLIT_SECRET_KIND = "split_secret"
SPLIT_JOIN_KIND = "split_join"
SPLIT_ACCEPT_KIND = "split_accept"
MAX_SPLIT_ENVELOPE = 512 << 10  # fits an entry (the ledger caps entries below 1 MiB for gossip)


def check_body(kind: str, body: Any) -> dict:
    """`body` if it fits `kind`'s spec (kinds without one pass); else BodyError naming the field."""
    if not isinstance(body, dict):
        raise BodyError(f"{kind} entry body must be a map, got {type(body).__name__}")
    spec = SPECS.get(kind)
    if spec is None:
        return body
    for name, types in spec.required.items():
        if name not in body:
            raise BodyError(f"{kind} entry body lacks field {name!r}")
    for name, types in {**spec.required, **spec.optional}.items():
        if name not in body:
            continue
        v = body[name]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise BodyError(f"{kind} entry field {name!r} must be {'/'.join(t.__name__ for t in types)}, "
                            f"got {type(v).__name__}")
        elem = spec.items.get(name)
        if elem is not None and not all(isinstance(x, elem) and not (isinstance(x, bool) and bool not in elem)
                                         for x in v):
            raise BodyError(f"{kind} entry field {name!r} must list {'/'.join(t.__name__ for t in elem)} values")
    return body


def append(led: Ledger, signer: Signer, kind: str, body: dict) -> Entry:
    """Validate `body`, then sign and append it (what every writer of a typed kind calls)."""
    return led.append(signer, kind, check_body(kind, body))


def body_of(entry: Entry) -> dict:
    """The entry's body, validated against its kind's spec (BodyError if it does not fit)."""
    try:
        return check_body(entry.kind, entry.body)
    except BodyError as exc:
        raise BodyError(f"entry {entry.id.hex()[:16]}: {exc}") from None


def fits(entry: Entry) -> bool:
    """Whether the entry's body fits its kind's spec (readers that skip misfits use this)."""
    try:
        check_body(entry.kind, entry.body)
    except BodyError:
        return False
    return True


# Blob readers. A `weights` / `features` / `aggregate` entry names a blob (`"blob": hex`).
# If its body carries a reader list, the blob protocol serves that blob only to the peers
# on the list and to the entry's author, and other daemons do not try to fetch it.
# `readers` (list of libp2p peer ids) is the field to write (e.g. MSD's distilled body for
# its authorised clients). Two older spellings are read as reader lists too, so entries
# already in ledgers keep their meaning: `recipients` (sealed `features`: the peers it is
# encrypted to) and `authorized` (MSD bodies written before `readers` existed). A body with
# none of them is readable by every member.
READERS = "readers"
READER_ALIASES = ("recipients", "authorized")


def blob_readers(body: dict) -> frozenset[str] | None:
    """The peer ids a blob named by `body` may be served to (besides its author), or None
    for "every member". A malformed list (not a list of strings) restricts to nobody."""
    for key in (READERS, *READER_ALIASES):
        if key in body:
            value = body[key]
            if isinstance(value, list) and all(isinstance(p, str) for p in value):
                return frozenset(value)
            return frozenset()
    return None


# The entry-body section of INTERFACES.md is generated from SPECS (tests/test_bodies_doc.py
# checks it is current): `python -m atdnode.bodies INTERFACES.md` rewrites it in place.
DOC_BEGIN = "<!-- entry bodies: generated by `python -m atdnode.bodies INTERFACES.md`; do not edit -->"
DOC_END = "<!-- end of generated entry bodies -->"


def _types(types: tuple[type, ...]) -> str:
    return "/".join("null" if t is type(None) else "number" if t is float else t.__name__ for t in types
                    if not (t is int and float in types))


def _fields(spec: BodySpec, names: Mapping[str, tuple[type, ...]]) -> str:
    out = []
    for name, types in names.items():
        elem = spec.items.get(name)
        out.append(f"`{name}`: {_types(types)}" + (f"[{_types(elem)}]" if elem else ""))
    return ", ".join(out) or "(none)"


def spec_markdown() -> str:
    """The entry-body contract as markdown: one line per kind, its required and optional fields."""
    lines = [DOC_BEGIN, "", "| kind | required fields | optional fields |", "|---|---|---|"]
    for kind, spec in SPECS.items():
        lines.append(f"| `{kind}` | {_fields(spec, spec.required)} | {_fields(spec, spec.optional)} |")
    lines += ["", "Unknown extra fields are allowed (a newer peer may add some); a missing required field or a "
              "wrong type is a `BodyError` on write and on read.", "", DOC_END]
    return "\n".join(lines)


def update_doc(text: str) -> str:
    """`text` with the part between DOC_BEGIN and DOC_END replaced by :func:`spec_markdown`."""
    from atdnode.docsections import replace_section

    return replace_section(text, DOC_BEGIN, DOC_END, spec_markdown(), "entry-body")


if __name__ == "__main__":
    from atdnode.docsections import rewrite_main

    rewrite_main(update_doc, "atdnode.bodies")
