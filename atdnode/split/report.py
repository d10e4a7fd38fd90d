"""Communication records of split-learning sessions and `atd split report`.

A record is one JSON file under ``HOME/split/records/``: written by a client after its
session (``side: "client"``) and by a server for each of its clients after every round
(``side: "server"``). It holds the measured bytes (a `ByteCounter` dict: per direction
and message kind, wire and payload bytes), the paper's symbols for that client
(`CostParams`: D, B, R, n, F, G, Ph, Pb, Pt), the training message kinds, and the task
metric. The report puts measured wire bytes of the training messages next to the
formulas of the p-FESTA paper for the same symbols:

    T_FL     = 2R/n (Ph+Pb+Pt)            T_SL     = 2BR(F+G)
    T_FESTA  = 2BR(F+G) + 2R/n (Ph+Pt)    T_pFESTA = DF + BR(F+G) + 2R Pt/n
    T_MSD    = DF + Pb                    (MSD Eq. 9; one round: upload once, body down once)
    T_FL-SSL = 4R/n (Ph+Pb+Pt)            (MSD Eq. 8: federated SSL, teacher + student up and down)

An MSD row also carries T_FL-SSL at the MSD paper's FL schedule (Table VII: R = 50 rounds,
aggregated every round) and the ratios T_MSD / T_FL-SSL and measured / T_FL-SSL (the paper:
about 0.25).

and the relative error of the measurement against the formula of its own algorithm.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from atdnode.errors import AtdError
from atdnode.node import NodeHome
from protocols.comm_cost import MSD_TABLE7_FL_ROUNDS, VARIANT_FORMULAS, ByteCounter, CostParams, formulas, t_fl_ssl

RECORD_VERSION = 1
_REQUIRED = ("version", "side", "algorithm", "client", "server", "task", "params", "counter", "train_kinds")


class SplitReportError(AtdError):
    """A comm record is missing or unreadable; the message names the file."""


def own_formula(algorithm: str, p: CostParams, variant: dict | None = None) -> float:
    """The formula a record's bytes are checked against: its algorithm's, or for p-FESTA's
    learnable-head ablation `comm_cost.t_pfesta_learnable_head`."""
    if algorithm == "pfesta" and (variant or {}).get("head") == "learnable":
        return VARIANT_FORMULAS["pfesta_learnable_head"](p)
    return formulas(p)[algorithm]


def records_dir(home: NodeHome) -> Path:
    return Path(home.root) / "split" / "records"


def make_record(*, side: str, algorithm: str, client: str, server: str, task: dict, params: CostParams | None,
                counter: dict, train_kinds: tuple[str, ...] | list[str], rounds: list[int],
                metrics: dict | None = None, **extra: Any) -> dict[str, Any]:
    """A record dict (JSON values only); ``counter`` is a ByteCounter dict (only ``client``'s rows kept)."""
    rows = [r for r in counter.get("rows", []) if r.get("client") == client]
    return {"version": RECORD_VERSION, "side": side, "algorithm": algorithm, "client": client, "server": server,
            "task": dict(task), "params": None if params is None else asdict(params), "counter": {"rows": rows},
            "train_kinds": list(train_kinds), "rounds": list(rounds), "metrics": dict(metrics or {}),
            "written": time.time(), **extra}


def server_record(**kw: Any) -> dict[str, Any]:
    return make_record(side="server", **kw)


def write_record(home: NodeHome, record: dict[str, Any], *, name: str | None = None) -> Path:
    """Write ``record`` atomically; returns its path. ``name`` (no suffix) defaults to a
    timestamped one, so successive client sessions never overwrite each other."""
    d = records_dir(home)
    d.mkdir(parents=True, exist_ok=True)
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(record.get("written", time.time())))
        name = f"{stamp}-{record['algorithm']}-{record['task'].get('name', 'task')}-{record['server'][-8:]}-{os.getpid()}"
    path = d / f"{name}.json"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_records(home: NodeHome) -> list[dict[str, Any]]:
    """Every record of the home, oldest first; SplitReportError naming a bad file."""
    d = records_dir(home)
    out = []
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SplitReportError(f"{path}: unreadable comm record ({e})") from None
        check_record(rec, path)
        rec["_path"] = str(path)
        out.append(rec)
    return sorted(out, key=lambda r: (r.get("written", 0), r["_path"]))


def check_record(rec: Any, where: Any) -> None:
    if not isinstance(rec, dict) or any(k not in rec for k in _REQUIRED):
        raise SplitReportError(f"{where}: not a comm record (needs {', '.join(_REQUIRED)})")
    if rec["version"] != RECORD_VERSION:
        raise SplitReportError(f"{where}: record version {rec['version']!r} is not {RECORD_VERSION}")
    try:
        ByteCounter.from_dict(rec["counter"])
        if rec["params"] is not None:
            CostParams(**rec["params"])
    except (TypeError, ValueError) as e:
        raise SplitReportError(f"{where}: bad counter or params: {e}") from None


def report_row(rec: dict[str, Any]) -> dict[str, Any]:
    """Measured training bytes of one record next to the four formulas (and MSD's)."""
    counter = ByteCounter.from_dict(rec["counter"])
    c, kinds = rec["client"], rec["train_kinds"]
    measured = counter.total(c, kinds=kinds)
    row: dict[str, Any] = {
        "side": rec["side"], "client": c, "server": rec["server"], "algorithm": rec["algorithm"],
        "task": rec["task"].get("name"), "rounds": len(rec.get("rounds", [])),
        "measured": measured, "measured_up": counter.total(c, "up", kinds),
        "measured_down": counter.total(c, "down", kinds),
        "measured_payload": counter.total(c, kinds=kinds, payload=True),
        "other_bytes": counter.total(c) - measured, "metrics": rec.get("metrics", {}),
        "params": rec["params"], "record": rec.get("_path"), "variant": rec.get("variant"),
    }
    if rec["params"] is not None:
        p = CostParams(**rec["params"])
        f = formulas(p)
        row.update({"T_FL": f["fl"], "T_SL": f["sl"], "T_FESTA": f["festa"], "T_pFESTA": f["pfesta"],
                    "T_MSD": f["msd"], "formula": own_formula(rec["algorithm"], p, rec.get("variant"))})
        row["rel_error"] = (measured - row["formula"]) / row["formula"] if row["formula"] else None
        if rec["algorithm"] == "msd":
            fl = t_fl_ssl(replace(p, R=MSD_TABLE7_FL_ROUNDS, n=1))
            row.update({"T_FL_SSL": fl, "msd_ratio": f["msd"] / fl if fl else None,
                        "measured_ratio": measured / fl if fl else None})
    return row


def _kb(v: Any) -> str:
    return "-" if v is None else f"{v / 1000:,.1f}"


def _variant(v: dict | None) -> str:
    """p-FESTA's ablation switches where they differ from the paper's method, e.g. "[learnable-head]"."""
    tags = ([f"{v['head']}-head"] if v and v.get("head", "fixed") != "fixed" else []) + \
        (["no-pos-embed"] if v and v.get("pos_embed") is False else [])
    return f"[{','.join(tags)}]" if tags else ""


def render(rows: list[dict[str, Any]]) -> str:
    """A plain-text table (kB = 1000 bytes); measured = wire bytes of the training messages."""
    head = ("side", "client", "algo", "task", "R", "measured kB", "formula kB", "err %",
            "T_FL", "T_SL", "T_FESTA", "T_pFESTA", "metric")
    lines = [head]
    for r in rows:
        err = "-" if r.get("rel_error") is None else f"{100 * r['rel_error']:+.2f}"
        metric = " ".join(f"{k}={v:.3f}" for k, v in r["metrics"].items() if isinstance(v, (int, float)))
        lines.append((r["side"], r["client"][-8:], r["algorithm"] + _variant(r.get("variant")), str(r["task"]), str(r["rounds"]),
                      _kb(r["measured"]), _kb(r.get("formula")), err, _kb(r.get("T_FL")), _kb(r.get("T_SL")),
                      _kb(r.get("T_FESTA")), _kb(r.get("T_pFESTA")), metric or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    for r in rows:
        if r.get("T_FL_SSL") is not None:
            text.append(f"{r['side']} {r['client'][-8:]} msd: T_MSD (Eq. 9) {_kb(r['T_MSD'])} kB, measured "
                        f"{_kb(r['measured'])} kB; T_FL-SSL (Eq. 8, R={MSD_TABLE7_FL_ROUNDS}, r=1) "
                        f"{_kb(r['T_FL_SSL'])} kB; ratio {r['msd_ratio']:.3f} by formula, "
                        f"{r['measured_ratio']:.3f} measured (MSD Table VII: about 0.25)")
    return "\n".join(text)
