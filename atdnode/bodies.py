"""The bodies of ledger entries, typed in one place: every writer and reader goes through here.

Each kind has a `BodySpec`: the fields it must have and may have, each with its JSON/msgpack
type, the element type of list fields, a `Format` where the value has one (entry and blob
ids as 64 lowercase hex digits, peer ids, enumerations, non-negative counts), and the spec
of nested maps (`groups`, `skipped`, `ensemble`). Every string is at most MAX_STR
characters, every list at most MAX_ITEMS long, every number finite. `check_body` validates
a body: writers call it through `append` before signing, every node calls it through
`refusal` on every entry merged from the network (`Ledger.merge(check=...)`, so nothing
reads a body that does not fit: the entry is refused, its author's chain waits behind it,
see `Ledger.merge`), and readers of older ledgers through `body_of` / `fits`. A field name
cannot drift between the code that writes an entry and the code that reads it. Unknown
extra fields are allowed (a newer peer may add some) and unchecked; missing required
fields, wrong types and malformed values are a `BodyError` naming the kind and the field.
To add a kind, add its spec to `SPECS`; a kind without one must still have a map body.

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
           round of `atd rounds` (campaign, round, reference, participants, missing;
           aggregator: the rule's name, `protocols.rounds.AGGREGATORS` -- absent in older
           entries, which are the weighted mean named by weighting; byzantine: a robust
           aggregator's f)
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

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from atdnode.errors import AtdError
from ledger import Entry, Ledger, Signer
from protocols.weightings import CLASSIFIERS as _CLASSIFIER_REGISTRY


class BodyError(AtdError):
    """An entry body lacks a required field or has one of the wrong type or form."""


_NUM = (int, float)
MAX_STR = 4096  # characters of any string field or list element the spec names
MAX_ITEMS = 10_000  # elements of any list field


@dataclass(frozen=True)
class Format:
    """What a value must look like beyond its type (checked on the value, or on each
    element of a list)."""

    what: str
    ok: Callable[[Any], bool]
    short: str  # for the generated table in INTERFACES.md


_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_PEER = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}\Z")  # base58 (libp2p peer ids: 12D3KooW...)
_NAME = re.compile(r"[a-z0-9][a-z0-9_.+-]{0,63}\Z")
HEX64 = Format("64 lowercase hex digits (an entry or blob id)", lambda v: isinstance(v, str) and bool(_HEX64.match(v)),
               "hex64")
PEER_ID = Format("a peer id", lambda v: isinstance(v, str) and bool(_PEER.match(v)), "peer id")
NAME = Format("a short lowercase name", lambda v: isinstance(v, str) and bool(_NAME.match(v)), "name")
COUNT = Format("a non-negative integer", lambda v: v >= 0, ">= 0")


def one_of(*values: str) -> Format:
    return Format(f"one of {', '.join(values)}", lambda v: v in values, " / ".join(values))


PARTS = ("full", "extractor", "head", "body")
MODES = ("horizontal", "vertical", "group", "hierarchical", "round")
CLASSIFIERS = tuple(_CLASSIFIER_REGISTRY)


@dataclass(frozen=True)
class BodySpec:
    required: Mapping[str, tuple[type, ...]]
    optional: Mapping[str, tuple[type, ...]]
    items: Mapping[str, tuple[type, ...]]  # element types of list fields (when checked)
    formats: Mapping[str, Format] = field(default_factory=dict)  # form of a value (each element of a list)
    nested: Mapping[str, "BodySpec"] = field(default_factory=dict)  # spec of a map field (each map of a list)


def _spec(required: dict, optional: dict | None = None, items: dict | None = None, formats: dict | None = None,
          nested: dict | None = None) -> BodySpec:
    return BodySpec(required, optional or {}, items or {}, formats or {}, nested or {})


_BLOB = {"blob": (str,), "size": (int,), "manifest": (str,)}
_BLOB_FORMS = {"blob": HEX64, "size": COUNT, "manifest": HEX64}
_PEERS = {k: PEER_ID for k in ("readers", "authorized", "recipients", "participants", "missing")}
SPECS: dict[str, BodySpec] = {
    "weights": _spec({**_BLOB, "part": (str,), "model": (dict,), "labels": (list,), "label_fp": (str,),
                      "samples": (int,), "metrics": (dict,), "provenance": (list,)},
                     {"model_id": (str,), "base": (str,), "algorithm": (str,), "tasks": (list,),
                      "authorized": (list,), "readers": (list,), "campaign": (str,), "round": (int,),
                      "start": (str,), "class_counts": (dict,), "data_fp": (str,)},
                     {"labels": (str,), "provenance": (str,), "authorized": (str,), "readers": (str,)},
                     {**_BLOB_FORMS, **_PEERS, "part": one_of(*PARTS), "samples": COUNT, "round": COUNT,
                      "start": HEX64}),
    "features": _spec({**_BLOB, "recipients": (list,), "shape": (list,), "classes": (list,), "label_fp": (str,),
                       "samples": (int,), "model": (dict,), "extractor": (str,), "alg": (str,)},
                      {"model_id": (str,), "provenance": (list,)},
                      {"recipients": (str,), "shape": (int,), "classes": (str,), "provenance": (str,)},
                      {**_BLOB_FORMS, **_PEERS, "shape": COUNT, "samples": COUNT, "extractor": HEX64}),
    "aggregate": _spec({**_BLOB, "mode": (str,), "weighting": (str,), "weights": (list,), "inputs": (list,),
                        "head": (bool,), "part": (str,)},
                       {"model": (dict, type(None)), "q": _NUM, "groups": (list,), "ensemble": (dict,),
                        "classifier": (str,), "reference": (str,), "name": (str,), "n_classes": (int,),
                        "n_models": (int,), "skipped": (list,), "base": (str,),
                        "campaign": (str,), "round": (int,), "participants": (list,), "missing": (list,),
                        "cosines": (list,), "aggregator": (str,), "byzantine": (int,)},
                       {"weights": _NUM, "inputs": (str,), "groups": (dict,), "skipped": (dict,),
                        "participants": (str,), "missing": (str,), "cosines": _NUM},
                       {**_BLOB_FORMS, **_PEERS, "mode": one_of(*MODES), "part": one_of(*PARTS), "weighting": NAME,
                        "inputs": HEX64, "reference": HEX64, "classifier": one_of(*CLASSIFIERS), "round": COUNT,
                        "n_classes": COUNT, "n_models": COUNT},
                       {"groups": _spec({"name": (str,), "entry": (str,), "n_classes": (int,), "n_models": (int,)},
                                        formats={"entry": HEX64, "n_classes": COUNT, "n_models": COUNT}),
                        "skipped": _spec({"entry": (str,), "why": (str,)}, formats={"entry": HEX64}),
                        "ensemble": _spec({**_BLOB, "classes": (list,), "samples": (int,)},
                                          {"features": (list,), "own_samples": (int,)},
                                          {"classes": (str,), "features": (str,)},
                                          {**_BLOB_FORMS, "samples": COUNT, "own_samples": COUNT})}),
    "hello": _spec({"addrs": (list,), "x25519": (bytes,)}, {"role": (str,), "name": (str, type(None))},
                   {"addrs": (str,)}),
    "metrics": _spec({}),
    "service": _spec({"role": (str,), "protocol": (str,)}),
    "split_secret": _spec({"service": (str,), "recipients": (list,), "envelope": (bytes,), "alg": (str,)},
                          items={"recipients": (str,)}, formats={"service": HEX64, "recipients": PEER_ID}),
    "split_join": _spec({"service": (str,)}, formats={"service": HEX64}),
    "split_accept": _spec({"service": (str,), "clients": (list,)}, {"secret": (str,)}, {"clients": (str,)},
                          formats={"service": HEX64, "clients": PEER_ID, "secret": HEX64}),
    "plan": _spec({"name": (str,), "created": (int,), "late": (str,), "members": (list,), "steps": (list,)},
                  {"model": (dict,)}, {"members": (str,), "steps": (dict,)}),
    "plan_decision": _spec({"plan": (str,), "decision": (str,)}, {"reason": (str,)}, formats={"plan": HEX64}),
    "plan_step": _spec({"plan": (str,), "step": (str,), "status": (str,), "results": (list,)},
                       {"reason": (str,), "missing": (list,), "model": (str,), "metrics": (dict,), "started": _NUM,
                        "seconds": _NUM},
                       {"results": (str,), "missing": (str,)}, formats={"plan": HEX64}),
}
PLAN_KIND, PLAN_DECISION_KIND, PLAN_STEP_KIND = "plan", "plan_decision", "plan_step"
SPLIT_SECRET_KIND = "split_secret"
SPLIT_JOIN_KIND = "split_join"
SPLIT_ACCEPT_KIND = "split_accept"
MAX_SPLIT_ENVELOPE = 512 << 10  # fits an entry (the ledger caps entries below 1 MiB for gossip)


def _names(types: tuple[type, ...]) -> str:
    return "/".join(t.__name__ for t in types)


def _typed(v: Any, types: tuple[type, ...]) -> bool:
    return isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


def _value_problem(v: Any, form: Format | None) -> str | None:
    """Why the scalar `v` is malformed (beyond its type), or None."""
    if isinstance(v, str) and len(v) > MAX_STR:
        return f"is {len(v)} characters long (at most {MAX_STR})"
    if isinstance(v, float) and not math.isfinite(v):
        return "is not a finite number"
    if form is not None and not form.ok(v):
        return f"must be {form.what}"
    return None


def _check_map(kind: str, body: dict, spec: BodySpec, where: str = "") -> None:
    for name in spec.required:
        if name not in body:
            raise BodyError(f"{kind} entry body lacks field {where}{name!r}")
    for name, types in (*spec.required.items(), *spec.optional.items()):
        if name not in body:
            continue
        v, label = body[name], f"{where}{name!r}"
        if not _typed(v, types):
            raise BodyError(f"{kind} entry field {label} must be {_names(types)}, got {type(v).__name__}")
        form, sub = spec.formats.get(name), spec.nested.get(name)
        if isinstance(v, list):
            if len(v) > MAX_ITEMS:
                raise BodyError(f"{kind} entry field {label} has {len(v)} elements (at most {MAX_ITEMS})")
            elem = spec.items.get(name)
            for x in v:
                if elem is not None and not _typed(x, elem):
                    raise BodyError(f"{kind} entry field {label} must list {_names(elem)} values")
                why = _value_problem(x, form) if elem is not None else None
                if why is not None:
                    raise BodyError(f"{kind} entry field {label}: an element {why}")
                if sub is not None:
                    _check_map(kind, x, sub, f"{name}[].")
        else:
            why = _value_problem(v, form)
            if why is not None:
                raise BodyError(f"{kind} entry field {label} {why}")
            if sub is not None and isinstance(v, dict):
                _check_map(kind, v, sub, f"{name}.")


def check_body(kind: str, body: Any) -> dict:
    """`body` if it fits `kind`'s spec (kinds without one: any map); else BodyError naming the field."""
    if not isinstance(body, dict):
        raise BodyError(f"{kind} entry body must be a map, got {type(body).__name__}")
    spec = SPECS.get(kind)
    if spec is not None:
        _check_map(kind, body, spec)
    return body


def refusal(entry: Entry) -> str | None:
    """Why a merged entry's body does not fit its kind's spec, or None: the check every
    node hands `Ledger.merge` for entries from the network (`check=refusal`)."""
    try:
        check_body(entry.kind, entry.body)
    except BodyError as exc:
        return str(exc)
    return None


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
        form = spec.formats.get(name)
        out.append(f"`{name}`: {_types(types)}" + (f"[{_types(elem)}]" if elem else "")
                   + (f" ({form.short})" if form else ""))
    return ", ".join(out) or "(none)"


def spec_markdown() -> str:
    """The entry-body contract as markdown: one line per kind, its required and optional fields."""
    lines = [DOC_BEGIN, "", "| kind | required fields | optional fields |", "|---|---|---|"]
    for kind, spec in SPECS.items():
        lines.append(f"| `{kind}` | {_fields(spec, spec.required)} | {_fields(spec, spec.optional)} |")
    lines += ["", "Unknown extra fields are allowed (a newer peer may add some); a missing required field, a "
              "wrong type or a malformed value (parenthesised: hex64 = 64 lowercase hex digits, an entry or blob "
              f"id; strings at most {MAX_STR} characters, lists at most {MAX_ITEMS} elements, numbers finite) is a "
              "`BodyError` on write, a refused entry on merge from the network, and a skipped entry on read.",
              "", DOC_END]
    return "\n".join(lines)


def update_doc(text: str) -> str:
    """`text` with the part between DOC_BEGIN and DOC_END replaced by :func:`spec_markdown`."""
    from atdnode.docsections import replace_section

    return replace_section(text, DOC_BEGIN, DOC_END, spec_markdown(), "entry-body")


if __name__ == "__main__":
    from atdnode.docsections import rewrite_main

    rewrite_main(update_doc, "atdnode.bodies")
