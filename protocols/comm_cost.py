"""Communication accounting for split learning: measured bytes and the p-FESTA paper's formulas.

Measured side: :class:`ByteCounter` records every frame that crosses the client/server
boundary, per client, per direction (``"up"`` = client -> server, ``"down"`` = server ->
client) and per message kind, both as *wire* bytes (frame + 4-byte length prefix, what a
stream carries) and *payload* bytes (raw tensor bytes only). :class:`InProcessChannel`
is the in-process stand-in for a stream: it encodes, counts, and hands the receiver the
*decoded* copy, so in-process runs exercise the codec exactly as the network does.

Formula side (all figures are **per client**, in bytes; symbols as in the paper):

- ``D``  samples in the client's dataset (p-FESTA uploads each sample's features once);
- ``B``  samples the client processes per round (batches per round x batch size);
- ``R``  training rounds (FESTA: phase 1 + phase 2 rounds);
- ``n``  unifying period: rounds between two FedAvg exchanges of heads / tails
  (so there are R/n exchanges, each an upload and a download of the averaged part);
- ``F``  bytes of one sample's features crossing the cut in one direction;
- ``G``  bytes of one sample's gradient crossing the cut in one direction;
- ``Ph, Pb, Pt``  bytes of the head, body and tail parameters.

Interpretation (stated because the paper's symbol list is terse): ``n`` is read as the
averaging period, not the number of clients — with n = clients the per-client FL cost
would fall as clients join, and 2R/n (...) would not be the R/n upload+download pairs of
a FedAvg every n rounds. ``F``/``G``/``B``/``D`` count per sample, which makes ``D*F``
(upload every sample once) and ``B*R*(F+G)`` consistent.

- ``T_FL     = 2R/n (Ph+Pb+Pt)``     whole model up and down every n rounds;
- ``T_SL     = 2BR(F+G)``            U-shaped split: features up and back, gradients up and back;
- ``T_FESTA  = 2BR(F+G) + 2R/n (Ph+Pt)``  split traffic plus head/tail averaging;
- ``T_pFESTA = DF + BR(F+G) + 2R Pt/n``   one upload of permuted embeddings, then per
  sample the body output down and its gradient up, plus tail averaging;
- ``T_MSD    = DF + Pb``             (MSD Eq. 9) one upload of permuted embeddings, the
  distilled body down once; fine-tuning is local. The clients' embedder secret (Ph) is
  sealed on the ledger, not sent to the server, and is not counted;
- ``T_FL-SSL = 4R/n (Ph+Pb+Pt)``    (MSD Eq. 8, ``4 (R/r) P``) federated self-supervised
  learning: teacher and student, up and down, every n (the paper's r) of R rounds. The MSD
  paper's "about 25 % of FL" (Table VII) is ``T_MSD / T_FL-SSL``; its FL ran R = 50 rounds
  aggregated every round (:data:`MSD_TABLE7_FL_ROUNDS`).

Frame headers (tens of bytes per message) are counted in wire bytes but not by the
formulas; at realistic batch sizes they are well under 1 %.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from protocols.tensor_frames import (DEFAULT_MAX_FRAME_BYTES, LENGTH_PREFIX_BYTES, Frame,
                                     decode_frame, encode_frame)

Direction = Literal["up", "down"]
DIRECTIONS = ("up", "down")


class ByteCounter:
    """Bytes and message counts per (client, direction, kind). JSON-able via to_dict/from_dict."""

    def __init__(self) -> None:
        # (client, direction, kind) -> [messages, wire_bytes, payload_bytes]
        self._rows: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def record(self, client_id: str, direction: Direction, kind: str, *,
               wire_bytes: int, payload_bytes: int) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'up' or 'down', not {direction!r}")
        row = self._rows[(client_id, direction, kind)]
        row[0] += 1
        row[1] += wire_bytes
        row[2] += payload_bytes

    def clients(self) -> list[str]:
        return sorted({c for c, _, _ in self._rows})

    def kinds(self) -> list[str]:
        return sorted({k for _, _, k in self._rows})

    def total(self, client_id: str | None = None, direction: Direction | None = None,
              kinds: Iterable[str] | None = None, *, payload: bool = False) -> int:
        """Sum of wire bytes (or payload bytes) over the rows matching every given filter."""
        ks = None if kinds is None else set(kinds)
        col = 2 if payload else 1
        return sum(v[col] for (c, d, k), v in self._rows.items()
                   if (client_id is None or c == client_id) and (direction is None or d == direction)
                   and (ks is None or k in ks))

    def messages(self, client_id: str | None = None, kinds: Iterable[str] | None = None) -> int:
        ks = None if kinds is None else set(kinds)
        return sum(v[0] for (c, _, k), v in self._rows.items()
                   if (client_id is None or c == client_id) and (ks is None or k in ks))

    def merge(self, other: ByteCounter) -> None:
        for key, (m, w, p) in other._rows.items():
            row = self._rows[key]
            row[0] += m
            row[1] += w
            row[2] += p

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [{"client": c, "direction": d, "kind": k, "messages": v[0],
                          "wire_bytes": v[1], "payload_bytes": v[2]}
                         for (c, d, k), v in sorted(self._rows.items())]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ByteCounter:
        out = cls()
        try:
            for r in data["rows"]:
                if r["direction"] not in DIRECTIONS:
                    raise ValueError(f"bad direction {r['direction']!r}")
                out._rows[(str(r["client"]), r["direction"], str(r["kind"]))] = [
                    int(r["messages"]), int(r["wire_bytes"]), int(r["payload_bytes"])]
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a ByteCounter dict: {e}") from None
        return out


class InProcessChannel:
    """Carries messages between in-process peers exactly as a stream would: encode to a
    frame, count ``len(frame) + 4`` wire bytes, decode with full validation, deliver the copy."""

    def __init__(self, counter: ByteCounter | None = None, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.counter = counter if counter is not None else ByteCounter()
        self.max_bytes = max_bytes

    def send(self, client_id: str, direction: Direction, kind: str,
             tensors: Mapping[str, torch.Tensor] | None = None,
             meta: Mapping[str, Any] | None = None) -> Frame:
        frame = encode_frame(tensors, {"kind": kind, **(meta or {})}, max_bytes=self.max_bytes)
        decoded = decode_frame(frame, max_bytes=self.max_bytes)
        self.counter.record(client_id, direction, kind, wire_bytes=len(frame) + LENGTH_PREFIX_BYTES,
                            payload_bytes=decoded.payload_bytes)
        return decoded


@dataclass(frozen=True)
class CostParams:
    """The paper's symbols for one client (see module docstring); sizes in bytes."""

    D: int
    B: int
    R: int
    n: int
    F: int
    G: int
    Ph: int
    Pb: int
    Pt: int

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{k} must be a non-negative int, got {v!r}")
        if self.n < 1:
            raise ValueError("n (unifying period in rounds) must be >= 1")


def t_fl(p: CostParams) -> float:
    """Federated learning: the whole model (head, body, tail) up and down every n rounds."""
    return 2 * p.R / p.n * (p.Ph + p.Pb + p.Pt)


def t_sl(p: CostParams) -> float:
    """Split learning (U-shaped): per sample features and gradients both ways."""
    return 2 * p.B * p.R * (p.F + p.G)


def t_festa(p: CostParams) -> float:
    """FESTA: split-learning traffic plus head/tail FedAvg every n rounds."""
    return 2 * p.B * p.R * (p.F + p.G) + 2 * p.R / p.n * (p.Ph + p.Pt)


def t_pfesta(p: CostParams) -> float:
    """p-FESTA: one upload of the dataset's embeddings, body output down / gradient up,
    tail FedAvg every n rounds."""
    return p.D * p.F + p.B * p.R * (p.F + p.G) + 2 * p.R * p.Pt / p.n


def t_msd(p: CostParams) -> float:
    """MSD, Eq. 9: every sample's permuted embeddings up once (D F), the pre-trained body down
    once (Pb); a single round, so B, R, n, G, Ph and Pt do not enter."""
    return p.D * p.F + p.Pb


def t_fl_ssl(p: CostParams) -> float:
    """Federated self-supervised learning, MSD Eq. 8: ``T_FL = 4 (R/r) P`` -- the factor 4 is
    teacher and student, each up and down (MSD §V "communication cost"), every ``n`` (the
    paper's r) of ``R`` rounds; P = Ph + Pb + Pt, the whole model each network holds."""
    return 4 * p.R / p.n * (p.Ph + p.Pb + p.Pt)


def msd_vs_fl_ssl(msd: CostParams, fl: CostParams, *, measured_msd: float | None = None,
                  measured_fl_ssl: float | None = None) -> dict[str, float | None]:
    """T_MSD (Eq. 9) against T_FL-SSL (Eq. 8), by formula and, where given, measured: the
    ratio the MSD paper puts at about 0.25 (Table VII). ``msd`` holds MSD's symbols (D, F,
    Pb); ``fl`` the federated run's (R, n and the model sizes)."""
    t_m, t_f = t_msd(msd), t_fl_ssl(fl)
    out: dict[str, float | None] = {"T_MSD": t_m, "T_FL_SSL": t_f, "ratio": t_m / t_f if t_f else None,
                                    "measured_T_MSD": measured_msd, "measured_T_FL_SSL": measured_fl_ssl,
                                    "measured_ratio": None}
    if measured_msd is not None and measured_fl_ssl:
        out["measured_ratio"] = measured_msd / measured_fl_ssl
    return out


MSD_TABLE7_FL_ROUNDS = 50  # the MSD paper's FL comparison (Table VII): 50 rounds, r = 1


def t_pfesta_learnable_head(p: CostParams) -> float:
    """p-FESTA's learnable-head ablation (`protocols.pfesta`): nothing stored, so per sample
    embeddings up, body output down, gradient up, input gradient down, as in SL, plus tail
    FedAvg (heads stay on the clients): ``2BR(F+G) + 2R Pt/n``. Not a formula of the paper."""
    return 2 * p.B * p.R * (p.F + p.G) + 2 * p.R * p.Pt / p.n


FORMULAS = {"fl": t_fl, "sl": t_sl, "festa": t_festa, "pfesta": t_pfesta, "msd": t_msd, "fl_ssl": t_fl_ssl}
# formulas of this implementation's variants (kept out of `formulas()`, which lists the papers')
VARIANT_FORMULAS = {"pfesta_learnable_head": t_pfesta_learnable_head}


def formulas(p: CostParams) -> dict[str, float]:
    """Every formula (FL, SL, FESTA, p-FESTA, MSD Eq. 9, FL-SSL MSD Eq. 8) for the same parameters."""
    return {name: f(p) for name, f in FORMULAS.items()}


def compare(counter: ByteCounter, params: Mapping[str, CostParams], protocol: str,
            kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """One row per client: measured wire/payload bytes (restricted to ``kinds``, e.g. the
    training messages, leaving out evaluation) next to ``protocol``'s formula and the
    relative error ``(measured_wire - formula) / formula``, plus the other formulas."""
    known = {**FORMULAS, **VARIANT_FORMULAS}
    if protocol not in known:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {sorted(known)}")
    kinds = None if kinds is None else list(kinds)
    rows = []
    for client, p in sorted(params.items()):
        wire = counter.total(client, kinds=kinds)
        pred = known[protocol](p)
        rows.append({"client": client, "protocol": protocol,
                     "measured_up": counter.total(client, "up", kinds),
                     "measured_down": counter.total(client, "down", kinds),
                     "measured_wire": wire, "measured_payload": counter.total(client, kinds=kinds, payload=True),
                     "formula": pred, "rel_error": (wire - pred) / pred if pred else float("nan"),
                     "formulas": formulas(p), "params": asdict(p)})
    return rows


def tensor_bytes(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> int:
    """Raw byte size of a set of tensors (P_h, P_b, P_t for a state dict)."""
    ts = tensors.values() if isinstance(tensors, Mapping) else tensors
    return sum(t.numel() * t.element_size() for t in ts)
