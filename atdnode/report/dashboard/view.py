"""What the dashboard shows, as plain JSON-ready dicts built from the node's own state.

Every function here is synchronous and reads SQLite or files, so the server calls them in
worker threads (`trio.to_thread`), never on the event loop. Nothing here reads a blob's
bytes or a private key: the view holds only what `atd ledger show`, `atd member list`,
`atd models`, `atd classify` and `atd split report` already print.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from atdnode.bodies import fits
from atdnode.node import NodeHome
from ledger import Entry, Ledger, peer_id_from_public_key

TIMELINE_LIMIT = 300  # newest log entries shown; the ledger itself is unbounded


def short(text: str, n: int = 12) -> str:
    return text[:n]


def _scalar_metrics(m: dict) -> dict:
    """The numbers of a metrics dict, plus `accuracy_ci`: the recorded 95 % interval, else
    Wilson's from n (`atdnode.learning.metrics.wilson`) where n is known."""
    from atdnode.learning import wilson

    out = {k: v for k, v in (m or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    ci = ((m or {}).get("ci") or {}).get("accuracy") if isinstance((m or {}).get("ci"), dict) else None
    n, acc = out.get("n"), out.get("accuracy")
    if isinstance(ci, list) and len(ci) == 2:
        out["accuracy_ci"] = [float(ci[0]), float(ci[1])]
    elif isinstance(n, int) and n > 0 and isinstance(acc, float):
        out["accuracy_ci"] = wilson(int(round(acc * n)), n)
    return out


def summarize(e: Entry) -> str:
    """One line about an entry's body, as `atd ledger show` would describe it."""
    b = e.body
    if e.kind == "genesis":
        return f"consortium {b.get('consortium')!s}"
    if e.kind == "member":
        target = b.get("member")
        who = peer_id_from_public_key(target)[:16] if isinstance(target, bytes) and len(target) == 32 else "?"
        extra = f" upto {b.get('upto')}" if b.get("action") == "revoke" else (" (admin)" if b.get("admin") else "")
        return f"{b.get('action')} {who}{extra}"
    if e.kind == "hello":
        return f"role {b.get('role')}, {len(b.get('addrs') or [])} address(es)"
    if e.kind in ("weights", "features"):
        return f"{b.get('part', 'features')} {str(b.get('blob', ''))[:12]} ({b.get('size', '?')} bytes)"
    if e.kind == "aggregate":
        return f"{b.get('mode')} of {len(b.get('inputs') or [])} input(s) -> {str(b.get('blob', ''))[:12]}"
    if e.kind == "service":
        return f"{b.get('algorithm', b.get('role'))} server offer"
    return ", ".join(sorted(map(str, b)))[:80]


def carries(e: Entry) -> str:
    """What a weights / features entry carries, in words (a features entry has no `labels`)."""
    b = e.body
    if e.kind == "features":
        shape = [x for x in b.get("shape") or [] if isinstance(x, int)]
        dims = f" x {shape[-1]} features" if len(shape) >= 2 else ""
        rec = b.get("recipients") if isinstance(b.get("recipients"), list) else []
        return (f"{b.get('samples', '?')} samples{dims}, {len(b.get('classes') or [])} classes, "
                f"sealed to {len(rec)} peer(s)")
    return f"{b.get('part', '?')} weights, {len(b.get('labels') or [])} classes, {b.get('samples', '?')} samples"


def ledger_view(led: Ledger, me: bytes) -> dict[str, Any]:
    """Membership, peers' hellos, the timeline and the weights / features / aggregate entries."""
    m = led.membership()
    entries = led.query()
    typed = [e for e in entries if fits(e)]  # (an entry whose body does not fit its kind is only counted)
    hello: dict[bytes, dict] = {}
    for e in typed:
        if e.kind == "hello":
            hello[e.author] = e.body
    names = {k: (s.name or (hello.get(k) or {}).get("name")) for k, s in m.members.items()}

    def who(author: bytes) -> str:
        return names.get(author) or peer_id_from_public_key(author)[:16]

    members = []
    for k, s in sorted(m.members.items(), key=lambda kv: peer_id_from_public_key(kv[0])):
        h = hello.get(k) or {}
        members.append({
            "peer_id": peer_id_from_public_key(k), "name": who(k), "me": k == me, "founder": k == m.founder,
            "admin": s.admin, "revoked": s.revoked,
            "rotated_to": peer_id_from_public_key(m.rotations[k]) if k in getattr(m, "rotations", {}) else None,
            "role": h.get("role") or "node", "addrs": [a for a in h.get("addrs") or [] if isinstance(a, str)],
        })
    by_id = {e.id: e for e in entries}
    published = [{
        "id": e.id.hex(), "kind": e.kind, "author": who(e.author), "part": e.body.get("part", "features"),
        "carries": carries(e),
        "model": (e.body.get("model") or {}).get("name", ""), "labels": len(e.body.get("labels") or []),
        "samples": e.body.get("samples"), "size": e.body.get("size"), "blob": str(e.body.get("blob", "")),
        "metrics": _scalar_metrics(e.body.get("metrics") or {}),
        "recipients": len(e.body["recipients"]) if isinstance(e.body.get("recipients"), list) else None,
    } for e in typed if e.kind in ("weights", "features")]
    aggregates = []
    for e in typed:
        if e.kind != "aggregate":
            continue
        inputs = []
        for h in e.body.get("inputs") or []:
            src = by_id.get(bytes.fromhex(h)) if isinstance(h, str) and len(h) == 64 else None
            inputs.append({"id": str(h), "author": who(src.author) if src else "?"})
        aggregates.append({
            "id": e.id.hex(), "author": who(e.author), "mode": e.body.get("mode"),
            "weighting": e.body.get("weighting"), "weights": [float(w) for w in e.body.get("weights") or []
                                                              if isinstance(w, (int, float))],
            "inputs": inputs, "blob": str(e.body.get("blob", "")),
        })
    services = [{"id": e.id.hex(), "server": who(e.author), "algorithm": e.body.get("algorithm", e.body.get("role")),
                 "tasks": [t.get("name") for t in _list(e.body.get("tasks")) if isinstance(t, dict)]}
                for e in typed if e.kind == "service"]
    plans = plans_view(led, typed, {peer_id_from_public_key(k): who(k) for k in m.members})
    recent = entries[-TIMELINE_LIMIT:]
    stored = led.stored_at([e.id for e in recent])
    timeline = [{
        "id": e.id.hex(), "kind": e.kind, "author": who(e.author), "seq": e.seq, "lamport": e.lamport,
        "summary": summarize(e) if fits(e) else "(its body does not fit its kind: not read)",
        "stored": stored.get(e.id),
    } for e in reversed(recent)]
    return {"consortium": m.consortium, "members": members, "published": published, "aggregates": aggregates,
            "services": services, "plans": plans, "timeline": timeline, "entries": len(entries), "states": led.stats(),
            "kinds": _count_kinds(entries)}


def plans_view(led: Ledger, entries: list[Entry], names: dict[str, str], now: float | None = None) -> list[dict]:
    """Every plan on the ledger, newest first, with each member's decision and state per step
    (`atdnode.plans.progress`: done, failed with its reason, declined, waiting), a waiting
    step whose inputs are all here shown as running (`atdnode.plans.running`); member names
    where known. A plan no member can carry out (`atdnode.plans.check_plan`: members decline
    it) is listed with the reason and no steps."""
    from atdnode.errors import AtdError
    from atdnode.plans import load_view, progress, running

    out = []
    for e in reversed([e for e in entries if e.kind == "plan"]):
        author = names.get(peer_id_from_public_key(e.author), peer_id_from_public_key(e.author)[:16])
        try:
            view = load_view(led, e.id.hex())
        except AtdError as exc:
            out.append({"id": e.id.hex(), "name": str(e.body.get("name", "?"))[:80], "author": author, "steps": [],
                        "done": 0, "total": 0, "states": {}, "invalid": str(exc).splitlines()[0][:200]})
            continue
        busy = running(view, now)
        rows = [dict(r, member=names.get(r["member"], r["member"][:16]),
                     state="running" if r["state"] == "waiting" and (r["step"], r["member"]) in busy else r["state"],
                     missing=[names.get(x, x[:16]) for x in r["missing"]]) for r in progress(view)]
        out.append({"id": view.id, "name": view.body["name"], "author": author, "steps": rows,
                    "done": sum(r["state"] == "done" for r in rows), "total": len(rows),
                    "states": {k: sum(r["state"] == k for r in rows) for k in PLAN_STATES}})
    return out


PLAN_STATES = ("done", "running", "waiting", "failed", "declined")


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


def _count_kinds(entries: list[Entry]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        out[e.kind] = out.get(e.kind, 0) + 1
    return out


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def models_view(home: NodeHome) -> list[dict]:
    """The registry's models: how each was made, its training test metrics and every later
    evaluation (`atd classify`, newest last) with its confusion PNG when it lies in the home.
    Data specs are shown without their path (`atdnode.data.public_spec`)."""
    from atdnode.data import public_data_spec as public_spec
    from atdnode.models import ModelRegistry, made_by

    reg = ModelRegistry(home)
    out = []
    for r in reg.list():
        c = r.model
        evals = []
        for ev in reg.evaluations(r.id):
            png = Path(str(ev.get("png") or ""))
            evals.append({"data": public_spec(ev.get("data")), "split": ev.get("split"), "time": ev.get("time"),
                          "png": png.name if classify_png(home, png.name) == png.resolve() else None,
                          "metrics": _scalar_metrics({k: v for k, v in ev.items() if k != "time"})})
        out.append({
            "id": r.id, "created": r.created, "kind": made_by(r),
            "model": c.get("name", ""), "arch": f"{c.get('img_size')}/{c.get('patch_size')}/{c.get('embed_dim')}/{c.get('depth')}",
            "classes": len(r.labels), "samples": r.samples, "metrics": _scalar_metrics(r.metrics),
            "confusion": bool(r.files.get("confusion_png")), "classified": evals,
            "latest_accuracy": reg.latest_metrics(r)[0].get("accuracy"), "default": False,
            "not_kept": r.provenance.get("kept_why") if r.provenance.get("kept") == "own" else None,
        })
    if out:  # the model `atd classify` / `atd predict` use without --model (the same function)
        from atdnode.models import model_in_use

        use = model_in_use(home)
        for m in out:
            if m["id"] == use.record.id:
                m["default"], m["in_use_why"] = True, use.why
    return list(reversed(out))  # newest first


def confusion_path(home: NodeHome, model_id: str) -> Path | None:
    """The training confusion PNG a model record names, if it lies inside the home."""
    from atdnode.models import ModelRegistry

    if not model_id.isalnum():
        return None
    for r in ModelRegistry(home).list():
        if r.id == model_id and r.files.get("confusion_png"):
            return _inside(home, home.root / r.files["confusion_png"])
    return None


def classify_png(home: NodeHome, name: str) -> Path | None:
    if "/" in name or not name.endswith(".png") or name.startswith("."):
        return None
    return _inside(home, home.root / "classify" / name)


def _inside(home: NodeHome, path: Path) -> Path | None:
    p = path.resolve()
    return p if p.is_file() and p.is_relative_to(home.root) and p.suffix == ".png" else None


def split_view(home: NodeHome) -> list[dict]:
    """Split-learning sessions this node took part in (its `atd split report` records)."""
    from atdnode.split import records_dir

    d = records_dir(home)
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        r = _read_json(p)
        if not r:
            continue
        out.append({"name": p.stem, "side": r.get("side"), "algorithm": r.get("algorithm"),
                    "client": str(r.get("client", ""))[:16], "server": str(r.get("server", ""))[:16],
                    "task": (r.get("task") or {}).get("name"), "rounds": len(r.get("rounds") or []),
                    "metrics": _scalar_metrics(r.get("metrics") or {}), "written": r.get("written")})
    return out
