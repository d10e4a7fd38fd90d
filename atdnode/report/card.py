"""The facts of a model card (`atd report MODEL`): what an ethics board or a regulator asks
about one model, read from the signed ledger and the node's registry.

`collect(home, model)` returns a `Card`:

- the model (config, label space, its fingerprint, its blob hashes);
- every ledger entry that made it (`steps`): the weights entries it was trained from or
  published as, and the aggregate entries that combined them, followed through `inputs`,
  `reference` and `provenance` links; each with its author (peer id, name, role, admin /
  revoked in the consortium's membership as derived from the log), its kind, seq, lamport
  clock and state in the log, and whether its signature re-verifies from its raw bytes;
- for each aggregate entry: its inputs and their weights, and whether it re-verifies here
  (`atdnode.aggregation.verify.verify_entry`, the one implementation `atd aggregate --verify` uses):
  "verified" with the recomputed hash, "failed" with the reason, or "not checked" when its
  inputs are not held here;
- who trained on what: per weights entry the author, label space + fingerprint, sample
  count, reported metrics; for a model trained here also the class counts and the data
  fingerprint (sha256 of the loaded training tensors) and the source *kind* (never its path);
- every evaluation: the training test split and each later `atd classify`, with metrics,
  confusion matrix and (training) curves;
- the whole ledger's re-verification, in plain words (`ledger_words`);
- what the data owner says in `[card]` of config.toml (`card_statement`): intended
  and out-of-scope use, a description of the data, limitations;
- whether this node uses the model (`atdnode.aggregation.keep.use_of`): in use, or not kept
  by the keep decision after an aggregation, and why;
- the keep decision of the node (`atdnode.aggregation.keep`): the candidates' scores, what
  was kept and why, and whether this model is the one `atd classify` uses.

Nothing that names a local file or a patient is put on the card: data specs are reduced to
their source kind (`folder`, `dicom`, `npz`, ...), and evaluation PNG paths are dropped (the
card draws its own figures from the recorded numbers).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from atdnode.bodies import fits
from atdnode.data import public_data_spec as public_spec, source_kind
from atdnode.errors import AtdError
from atdnode.node import NodeConfig, NodeHome, check_card
from ledger import Entry, Ledger, LedgerError, peer_id_from_public_key

MAX_STEPS = 500  # a card follows at most this many entries back (hierarchies are shallow)


def card_statement(home: NodeHome) -> dict[str, str]:
    """What the data owner says on the card: the free-text fields of `[card]` in config.toml
    (intended use, out-of-scope use, data description, limitations), {field: text}, "" when
    unset. Checked by the settings' own rule (`atdnode.node.config_schema.check_card`, which
    `atd config set` also applies): a field that is not a string, is too long, or looks like a
    local path is a ConfigError naming the key; the data is described, never located."""
    return check_card(NodeConfig.load(home).extra.get("card"))


@dataclass
class Member:
    peer_id: str
    name: str
    role: str
    admin: bool
    revoked: bool
    founder: bool


@dataclass
class Step:
    """One ledger entry in the model's history."""

    id: str
    kind: str
    author: str  # peer id
    seq: int
    lamport: int
    state: str  # log | held | evidence
    signature: str  # "valid" or the reason it is not
    body: dict  # path-free summary of the entry body
    links: list[str] = field(default_factory=list)  # entry ids it names (inputs, reference, provenance)
    verification: dict | None = None  # aggregates: {"status": verified|failed|not checked, "detail": ...}


@dataclass
class Card:
    model_id: str
    made_by: str
    model: dict
    labels: list[str]
    label_fp: str
    samples: int
    blobs: dict
    source_kind: str
    class_counts: dict | None
    data_fp: str | None
    consortium: str | None
    members: dict[str, Member]
    steps: list[Step]
    evaluations: list[dict]
    ledger_check: str
    use: dict = field(default_factory=dict)  # atdnode.aggregation.keep.use_of: in use / not kept, and why
    ledger_ok: bool = True
    statement: dict[str, str] = field(default_factory=dict)
    keep: dict = field(default_factory=dict)
    in_use: bool = False  # this model is the one `atd classify` / `atd predict` use by default
    arch: str = ""


def collect(home: NodeHome, model: str = "latest") -> Card:
    """The card's facts for `model` (id, prefix, or `latest`: the model in use) of this node."""
    from atdnode.aggregation import use_of
    from atdnode.models import resolve_model
    from atdnode.blobs import BlobStore
    from atdnode.models import ModelRegistry, is_raw_pixels, made_by

    reg = ModelRegistry.of(home)
    rec = resolve_model(home, model)
    store = BlobStore.of(home)
    with Ledger.open(home.ledger_db) as led:
        ms = led.membership()
        steps = _steps(led, rec)
        for s in steps:
            if s.kind == "aggregate":
                s.verification = _verify(led, store, led.get(s.id))
        members = _members(led, ms, {s.author for s in steps})
        try:
            check, ledger_ok = ledger_words(led.verify()), True
        except LedgerError as exc:
            check, ledger_ok = f"The ledger does NOT re-verify on this node: {exc}", False
    prov = rec.provenance or {}
    use = use_of(home, rec)
    keep = {k: prov[k] for k in ("candidates", "kept", "kept_why", "keep_policy") if k in prov}
    return Card(model_id=rec.id, made_by=made_by(rec), model=dict(rec.model), labels=list(rec.labels),
                label_fp=rec.label_fp, samples=rec.samples, blobs=dict(rec.blobs),
                source_kind=source_kind(prov.get("data")), class_counts=prov.get("class_counts"),
                data_fp=prov.get("data_fp"), consortium=ms.consortium, members=members, steps=steps,
                evaluations=_evaluations(reg, rec), ledger_check=check, ledger_ok=ledger_ok, use=use,
                statement=card_statement(home), keep=keep, in_use=use["status"] == "in use",
                arch=_arch(rec.model) if not is_raw_pixels(rec) else
                f"{prov.get('what') or 'an ensemble on raw pixels, no learned features'}; input "
                f"{rec.model.get('img_size')} px")


def _arch(model: dict) -> str:
    """The architecture as built (`ModelConfig.arch`), or the recorded name where the record's
    config does not parse (a card still renders for a damaged record)."""
    from atdnode.learning import ModelConfig
    from protocols.vit_config import ModelConfigError

    try:
        return ModelConfig.from_dict(model).arch()
    except ModelConfigError:
        return str(model.get("name", "unknown")) if isinstance(model, dict) else "unknown"


def ledger_words(report) -> str:
    """A ledger `VerifyReport` in plain words."""
    if not report.entries:
        return "This node's copy of the shared log is empty: nothing about this model was published."
    held = (f"; {report.held} wait for a missing earlier entry" if report.held else "")
    evidence = (f"; {report.evidence} are kept only as evidence against their author" if report.evidence else "")
    eq = (f"; {report.equivocators} member(s) signed conflicting entries" if report.equivocators else "")
    return (f"All {report.entries} records of the consortium's shared log were re-checked on this node: every "
            f"signature and every hash link holds ({report.log} accepted{held}{evidence}{eq}; "
            f"{report.authors} author(s)).")


def _roots(led: Ledger, rec) -> list[Entry]:
    """The entries that name this model: its aggregate, or weights entries of its blobs."""
    blobs = set(rec.blobs.values())
    roots = [e for e in led.query(kind="aggregate") + led.query(kind="weights")
             if fits(e) and e.body.get("blob") in blobs or e.body.get("model_id") == rec.id]
    agg = (rec.provenance or {}).get("aggregate")
    if isinstance(agg, str):
        e = _get(led, agg)
        if e is not None and e not in roots and fits(e):
            roots.insert(0, e)
    return roots


def _get(led: Ledger, hex_id: str) -> Entry | None:
    try:
        return led.get(hex_id, include_held=True)
    except ValueError:
        return None


def _links(e: Entry) -> list[str]:
    b = e.body
    out = [x for x in (b.get("inputs") or []) if isinstance(x, str)]
    if isinstance(b.get("reference"), str) and len(b["reference"]) == 64 and _is_hex(b["reference"]):
        out.append(b["reference"])
    out += [x for x in (b.get("provenance") or []) if isinstance(x, str) and len(x) == 64 and _is_hex(x)]
    return out


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
        return True
    except ValueError:
        return False


def _steps(led: Ledger, rec) -> list[Step]:
    """Breadth-first from the roots through every named entry (oldest first in the result)."""
    seen: dict[str, Step] = {}
    todo = list(_roots(led, rec))
    while todo and len(seen) < MAX_STEPS:
        e = todo.pop(0)
        eid = e.id.hex()
        if eid in seen:
            continue
        links = _links(e)
        seen[eid] = Step(id=eid, kind=e.kind, author=peer_id_from_public_key(e.author), seq=e.seq,
                         lamport=e.lamport, state=led.state(e.id) or "?", signature=_signature(e),
                         body=_summary(e), links=links)
        todo += [x for x in (_get(led, i) for i in links) if x is not None and fits(x)]  # (a misfit: not read)
    return sorted(seen.values(), key=lambda s: (s.lamport, s.author, s.seq))


def _signature(e: Entry) -> str:
    """Re-check the signature from the entry's raw bytes (not the stored verdict)."""
    try:
        Entry.from_bytes(e.to_bytes()).verify()
        return "valid"
    except (LedgerError, ValueError) as exc:
        return f"invalid: {exc}"


_KEEP = {
    "weights": ("blob", "size", "part", "labels", "label_fp", "samples", "metrics", "model_id", "base", "campaign",
                "round", "algorithm", "class_counts", "data_fp"),
    "aggregate": ("blob", "mode", "weighting", "weights", "inputs", "head", "part", "q", "reference", "classifier",
                  "n_classes", "n_models", "skipped", "base", "campaign", "round", "participants", "missing"),
}
_METRICS = ("n", "accuracy", "precision", "recall", "f1", "balanced_accuracy", "robust_accuracy")
_DETAILS = ("ci", "binary", "calibration", "per_class", "caution")  # structured figures a card shows


def _summary(e: Entry) -> dict:
    """The fields of an entry body a card shows: hashes, counts, labels, numbers (no paths)."""
    keep = _KEEP.get(e.kind, ())
    out = {k: e.body[k] for k in keep if k in e.body}
    if isinstance(out.get("metrics"), dict):
        out["metrics"] = {k: v for k, v in out["metrics"].items() if k in _METRICS and isinstance(v, (int, float))}
    m = e.body.get("model")
    if isinstance(m, dict):
        out["model"] = {k: m[k] for k in ("name", "img_size", "patch_size", "embed_dim", "depth", "num_heads",
                                          "in_chans", "stem") if k in m}
    return out


def _verify(led: Ledger, store, entry: Entry | None) -> dict:
    """Re-run the one aggregate verification (`agg_verify.verify_entry`) on this entry."""
    from atdnode.aggregation import verify_entry

    if entry is None:
        return {"status": "failed", "detail": "entry not in the ledger"}
    try:
        return {"status": "verified", "detail": verify_entry(led, store, entry)}
    except AtdError as exc:
        msg = str(exc)
        if "not held here" in msg:
            return {"status": "not checked", "detail": msg}
        return {"status": "failed", "detail": msg}


def _members(led: Ledger, ms, authors: set[str]) -> dict[str, Member]:
    """Every admitted member (and every author of a step), with its name and announced role."""
    hello: dict[bytes, dict] = {}
    for e in led.query(kind="hello"):
        hello[e.author] = e.body  # query is in log order: the newest hello wins
    keys = set(ms.members) | ({ms.founder} if ms.founder else set())
    out: dict[str, Member] = {}
    for k in keys:
        st = ms.members.get(k)
        h = hello.get(k, {})
        pid = peer_id_from_public_key(k)
        out[pid] = Member(peer_id=pid, name=str(h.get("name") or (st.name if st else "") or ""),
                          role=str(h.get("role") or "node"), admin=bool(st and st.admin),
                          revoked=bool(st and st.revoked), founder=ms.is_founder(k))
    for a in authors - set(out):
        out[a] = Member(peer_id=a, name="", role="?", admin=False, revoked=False, founder=False)
    return out


def _evaluations(reg, rec) -> list[dict]:
    """The training test split, then every later scoring; path-free."""
    out = []
    m = rec.metrics or {}
    if m:
        out.append({"what": "training test split", "source": public_spec((rec.provenance or {}).get("data")),
                    "split": "test", "kind": "model",
                    "metrics": {k: m[k] for k in _METRICS if isinstance(m.get(k), (int, float))},
                    "details": {k: m[k] for k in _DETAILS if isinstance(m.get(k), dict)},
                    "confusion": m.get("confusion"), "classes": list(rec.labels),
                    "history": [h for h in m.get("history") or [] if isinstance(h, dict)]})
    for ev in reg.evaluations(rec.id):
        out.append({"what": f"atd classify ({ev.get('kind', 'model')}, {ev.get('split', '?')} split)",
                    "source": public_spec(ev.get("data")), "time": ev.get("time"), "split": ev.get("split"),
                    "kind": ev.get("kind"),
                    "metrics": {k: ev[k] for k in _METRICS if isinstance(ev.get(k), (int, float))},
                    "details": {k: ev[k] for k in _DETAILS if isinstance(ev.get(k), dict)},
                    "confusion": ev.get("confusion"), "classes": ev.get("classes"), "history": []})
    return out
