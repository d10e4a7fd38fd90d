"""Serverless training rounds on the fabric (`atd rounds`): FedAvg / FedWAvg, optionally adversarial.

A *campaign* is fixed by its shared initial model and rule: every member builds the round-0
model deterministically (`torch.manual_seed(seed)` on the same config and label space ->
the same blob hash everywhere) and the campaign id is a hash of (init blob, weighting, q,
name). Entries (built by `weights_round_body` / `aggregate_round_body`, typed in atdnode.bodies):

weights    the usual `weights` body of a full set + campaign, round
aggregate  mode "round": campaign, round, weighting, q, reference (previous global blob;
           round 0: the init blob), inputs (canonically sorted weights entry ids),
           weights, participants / missing (peer ids), blob (the global model)

Round t on each member: if round t's aggregate already exists, adopt it; else train from
global t-1 (`atdnode.training.train`, the library behind `atd train`), publish, wait until
the blobs of every live member (all members; with a daemon, not those disconnected from it
for `absent_grace` s, nor, at the peer-set target, members outside the set that
sat out the previous round: `RoundRunner._live`) or of
--min-peers members are held, or the deadline passes, then the *coordinator* (smallest
publishing peer id) records the aggregate over the inputs it holds; the others wait for
that entry (up to another deadline, then record their own) and recompute it from its
inputs (`verify_round`, also reached by `atd aggregate --verify`), which gives the same
blob bit for bit. If two members recorded round t, the canonical one is the smallest
signer's (protocols.rounds); everyone re-reads it before training round t+1. A restarted
node derives its round from the ledger (one past the last canonical aggregate).

Waiting: blob readiness goes through the daemon's `fetch` control op (it returns when the
blob is stored); new entries are noticed by re-reading the local ledger every 0.5 s (the
daemon merges gossip into it; there is no push channel from daemon to CLI).

The loop is async and reaches its daemon and clock through a `Fabric`: `ControlFabric`
(the CLI: control socket, wall clock, run under `trio.run` by the sync wrappers
`run` / `run_round` / `global_blob` / `adopt`) or netsim's in-memory one
(`netsim.fat.MemFabric`: the daemon object in the same trio run, simulated clock). Every
rule above (inputs, coordinator, weights, verification) is the same code on both.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import trio

from atdnode import control
from atdnode import bodies
from atdnode.agg_check import check_recorded_weights, check_result
from atdnode.aggregate import AggregateError, average_blobs, register_global, result_meta
from atdnode.blobstore import BlobStore
from atdnode.data import load_dataset
from atdnode.data.sanity import require_classes
from atdnode.errors import AtdError
from atdnode.home import NodeHome
from atdnode.identity import NodeIdentity
from atdnode.model import ModelConfig, build_model, export_part
from atdnode.publish import weights_body
from atdnode.registry import ModelRecord
from atdnode.training import TrainOptions, train
from atdnode.weights import load_weights
from ledger import Entry, Ledger
from ledger.keys import peer_id_from_public_key
from protocols.aggregation import AggregationError
from protocols.rounds import (
    ROUND_WEIGHTINGS,
    canonical,
    canonical_aggregate,
    choose_coordinator,
    last_layer_vector,
    round_weights,
)

POLL_S = 0.5


class RoundsError(AtdError):
    """A round cannot run (bad config, no inputs) or a round aggregate does not verify."""


class Fabric:
    """How a round runner reaches its daemon and tells time (see the module doc).

    `fetch` returns once the blob is stored or raises an AtdError; `peers` lists the
    daemon's connected peers, or None when there is no daemon to ask. `wall_clock` says
    whether `now()` is the wall clock (the CLI) or a simulated one (netsim: compute takes
    no simulated time, so exchange time is the simulated network time)."""

    wall_clock = True

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    async def fetch(self, blob: str, timeout: float) -> None:
        raise RoundsError("no daemon to fetch from")

    async def peers(self) -> list[str] | None:
        return None

    def peer_target(self) -> int | None:
        """The daemon's peer-set target (config.toml `[peers] target`), None when unknown."""
        return None


class ControlFabric(Fabric):
    """The CLI's fabric: the node's daemon through its control socket."""

    def __init__(self, home: NodeHome) -> None:
        from atdnode.config import NodeConfig
        from atdnode.peerset import PeerSetConfig

        self.sock = home.control_socket
        try:  # read once, as the daemon does at start (not on every liveness poll)
            self._peer_target: int | None = PeerSetConfig.from_table(NodeConfig.load(home).extra.get("peers")).target
        except AtdError:
            self._peer_target = None

    def peer_target(self) -> int | None:
        return self._peer_target

    def _running(self) -> bool:
        return control.daemon_running(self.sock)

    async def fetch(self, blob: str, timeout: float) -> None:
        if not await trio.to_thread.run_sync(self._running):
            raise RoundsError("no daemon running")
        await trio.to_thread.run_sync(lambda: control.call(self.sock, "fetch", blob=blob, timeout_s=timeout,
                                                           timeout=timeout + 5))

    async def peers(self) -> list[str] | None:
        def ask() -> list[str] | None:
            if not self._running():
                return None
            try:
                return list(control.call(self.sock, "peers")["peers"])
            except AtdError:
                return None
        return await trio.to_thread.run_sync(ask)


@dataclass
class RoundsConfig:
    data: str
    cfg: ModelConfig
    rounds: int
    weighting: str = "fedwavg"
    q: float = 1.0
    local_epochs: int = 1
    batch_size: int = 16
    lr: float | None = None
    seed: int = 0
    deadline: float = 120.0  # seconds to wait for the round's inputs after publishing
    min_peers: int | None = None  # None: every live member
    absent_grace: float = 20.0  # a member not connected to our daemon this long is not waited for
    name: str = ""
    batch_transform: object | None = None  # atdnode.training.AdversarialTransform
    init_state: dict | None = None  # shared initial weights (default: a fresh model from `seed`)
    log: Callable[[str], None] = field(default=lambda _m: None)


@dataclass
class RoundReport:
    round: int
    entry: str
    blob: str
    inputs: list[str]
    weights: list[float]
    missing: list[str]
    coordinator: bool
    adopted: bool
    train_s: float = 0.0  # local training (compute, wall seconds)
    exchange_s: float = 0.0  # publish until the global is held, less aggregation compute
    aggregate_s: float = 0.0  # computing / recomputing the global model (compute, wall seconds)
    exchange_clock: str = "wall"  # "simulated" under netsim (network time only)
    bytes_out: int = 0
    bytes_in: int = 0
    metrics: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------- bodies

def weights_round_body(store: BlobStore, blob: str, record: ModelRecord, *, campaign: str, rnd: int) -> dict:
    return {**weights_body(store, blob, part="full", record=record), "campaign": campaign, "round": int(rnd)}


def aggregate_round_body(*, campaign: str, rnd: int, weighting: str, q: float, reference: str, inputs: list[str],
                         weights: list[float], participants: list[str], missing: list[str], store: BlobStore,
                         blob: str, model: dict) -> dict:
    return {"mode": "round", "campaign": campaign, "round": int(rnd), "weighting": weighting, "q": float(q),
            "reference": reference, "inputs": inputs, "weights": weights, "participants": participants,
            "missing": missing, "head": True, "part": "full", "blob": blob, "size": store.size(blob),
            "manifest": store.manifest(blob).hash, "model": model}


# ---------------------------------------------------------------- campaign state

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


def _signer(e: Entry) -> str:
    return peer_id_from_public_key(e.author)


def round_weights_entries(led: Ledger, campaign: str, rnd: int) -> list[Entry]:
    """Weights entries of round `rnd`, one per author (its first), canonically ordered."""
    by_author: dict[str, Entry] = {}
    for e in led.query(kind="weights"):
        b = e.body
        if b.get("campaign") == campaign and b.get("round") == rnd:
            a = _signer(e)
            if a not in by_author or e.id.hex() < by_author[a].id.hex():
                by_author[a] = e
    return sorted(by_author.values(), key=lambda e: e.id.hex())


def round_aggregate(led: Ledger, campaign: str, rnd: int) -> Entry | None:
    """Round `rnd`'s canonical aggregate entry, or None."""
    cands = [e for e in led.query(kind="aggregate")
             if e.body.get("mode") == "round" and e.body.get("campaign") == campaign and e.body.get("round") == rnd]
    if not cands:
        return None
    return cands[canonical_aggregate([(_signer(e), e.id.hex()) for e in cands])]


def current_round(led: Ledger, campaign: str) -> int:
    """One past the last round with an aggregate (a restarted node resumes here)."""
    rounds = {e.body.get("round") for e in led.query(kind="aggregate")
              if e.body.get("mode") == "round" and e.body.get("campaign") == campaign}
    r = 0
    while r in rounds:
        r += 1
    return r


def active_members(led: Ledger) -> list[str]:
    m = led.membership()
    return sorted(peer_id_from_public_key(k) for k, s in m.members.items() if not s.revoked and m.current(k) == k)


# ---------------------------------------------------------------- computing / verifying one round

def compute_round(store: BlobStore, inputs: list[Entry], *, weighting: str, q: float,
                  reference: str) -> tuple[list[float], str]:
    """Weights and global blob of a round over `inputs` (already canonically ordered)."""
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
    return weights, _meta_and_tensors(store, blobs[0], weighting, tensors)


def _meta_and_tensors(store: BlobStore, first: str, weighting: str, tensors: dict) -> tuple:
    return tensors, result_meta(store, first, part="full", mode="round", weighting=weighting)


def verify_round(led: Ledger, store: BlobStore, entry: Entry) -> str:
    """Recompute a `round` aggregate from its inputs and reference; returns the result hash."""
    b = entry.body
    ids = b.get("inputs") or []
    if not ids or ids != canonical(ids):
        raise AggregateError(f"aggregate {entry.id.hex()[:16]} does not verify: inputs are not canonically ordered")
    inputs = []
    for h in ids:
        e = led.get(bytes.fromhex(h))
        if e is None or e.kind != "weights" or e.body.get("campaign") != b.get("campaign") \
                or e.body.get("round") != b.get("round"):
            raise AggregateError(f"aggregate {entry.id.hex()[:16]}: input {h[:16]} is not a weights entry of its round")
        inputs.append(e)
    try:
        weights, (tensors, meta) = compute_round(store, inputs, weighting=str(b.get("weighting")),
                                                 q=float(b.get("q", 1.0)), reference=str(b.get("reference")))
    except RoundsError as exc:
        raise AggregateError(str(exc)) from None
    check_recorded_weights(entry, weights)
    return check_result(store, entry, tensors, meta)


# ---------------------------------------------------------------- the loop

class RoundRunner:
    """Runs a campaign's rounds for one node (see the module docstring)."""

    def __init__(self, home: NodeHome, config: RoundsConfig, *, fabric: Fabric | None = None) -> None:
        if config.weighting not in ROUND_WEIGHTINGS:
            raise RoundsError(f"--weighting {config.weighting!r}: choose from {', '.join(ROUND_WEIGHTINGS)}")
        if config.rounds < 1:
            raise RoundsError("--rounds must be at least 1")
        self.home, self.c = home, config
        self.fabric = fabric if fabric is not None else ControlFabric(home)
        self._agg_s = 0.0  # aggregation compute of the current round
        self.store = BlobStore(home.blobs_dir)
        self.ident = NodeIdentity.load(home)
        self.me = self.ident.peer_id
        self.init, self.cfg, self.labels, self.label_fp = init_blob(self.store, config.cfg, config.data, config.seed,
                                                                    state=config.init_state)
        self.campaign = campaign_id(self.init, config.weighting, config.q, config.name)

    # -- ledger helpers
    def _led(self) -> Ledger:
        return Ledger.open(self.home.ledger_db)

    # -- sync entry points (the CLI; each is one trio run of its async twin)
    def global_blob(self, rnd: int) -> str:
        return trio.run(self.global_blob_async, rnd)

    def adopt(self, agg: Entry) -> str:
        return trio.run(self.adopt_async, agg)

    def run_round(self, rnd: int) -> RoundReport:
        return trio.run(self.run_round_async, rnd)

    def run(self, on_round: Callable[[RoundReport], None] | None = None) -> list[RoundReport]:
        """Rounds from the ledger's current round to the last; returns what this run did."""
        return trio.run(self.run_async, on_round)

    # -- async core
    async def global_blob_async(self, rnd: int) -> str:
        """The global model entering round `rnd` (round 0: the shared init)."""
        if rnd == 0:
            return self.init
        with self._led() as led:
            agg = round_aggregate(led, self.campaign, rnd - 1)
        if agg is None:
            raise RoundsError(f"round {rnd - 1} has no aggregate yet")
        return await self.adopt_async(agg)

    async def adopt_async(self, agg: Entry) -> str:
        """Hold round aggregate `agg`'s global blob: recompute it from its inputs (fetched first)."""
        blob = str(agg.body.get("blob"))
        if self.store.has(blob):
            return blob
        with self._led() as led:
            inputs = [led.get(bytes.fromhex(h)) for h in agg.body.get("inputs") or []]
        for e in inputs:
            if e is not None:
                await self._await_blob(str(e.body.get("blob")), self.fabric.now() + max(self.c.deadline, 60.0))
        t = time.perf_counter()
        with self._led() as led:
            out = verify_round(led, self.store, agg)
        self._agg_s += time.perf_counter() - t
        return out

    async def _await_blob(self, blob: str, until: float) -> bool:
        while not self.store.has(blob):
            left = until - self.fabric.now()
            if left <= 0:
                return False
            try:
                await self.fabric.fetch(blob, left)
                continue
            except AtdError:
                pass
            await self.fabric.sleep(POLL_S)
        return True

    async def _live(self, expected: list[str], gone_since: dict[str, float], recent: set[str]) -> list[str]:
        """Members worth waiting for: every member, except (with a daemon) one that has not been
        connected to it for `absent_grace` seconds of this wait (a crashed member's connection
        drops at once; a restarting one reconnects within the grace and is waited for).

        With a bounded peer set (issue 15) a daemon at its peer target is not connected to
        every member, so "not connected" says nothing about a member outside the set: such a
        member is still waited for (until the deadline) when it took part in the previous
        round (`recent`); one that did not is not waited for after the grace."""
        peers = await self.fabric.peers()
        if peers is None:
            return expected
        now = self.fabric.now()
        for p in expected:
            if p == self.me or p in peers:
                gone_since.pop(p, None)
            else:
                gone_since.setdefault(p, now)
        target = self.fabric.peer_target()
        bounded = target is not None and len(set(peers) & set(expected)) >= target
        return [p for p in expected
                if now - gone_since.get(p, now) < self.c.absent_grace or (bounded and p in recent)]

    # -- one round
    def train_round(self, rnd: int, start: str) -> ModelRecord:
        opts = TrainOptions(epochs=self.c.local_epochs, batch_size=self.c.batch_size, lr=self.c.lr,
                            warmup_epochs=0.0, init_from=start, seed=self.c.seed * 1000 + rnd, augment=False,
                            device="cpu", epoch_eval=False, batch_transform=self.c.batch_transform,
                            extra_provenance={"campaign": self.campaign, "round": rnd})
        return train(self.home, self.c.data, self.cfg, opts)

    def publish(self, rnd: int, rec: ModelRecord) -> Entry:
        with self._led() as led:
            mine = [e for e in round_weights_entries(led, self.campaign, rnd) if _signer(e) == self.me]
            if mine:  # a restart after publishing: do not publish twice
                return mine[0]
            return bodies.append(led, self.ident.signer, "weights",
                                 weights_round_body(self.store, rec.blobs["full"], rec, campaign=self.campaign, rnd=rnd))

    async def wait_inputs(self, rnd: int, expected: list[str]) -> tuple[list[Entry], Entry | None]:
        """Until K publishers' blobs are held or the deadline: (held inputs, aggregate if one appeared)."""
        until = self.fabric.now() + self.c.deadline
        gone_since: dict[str, float] = {}
        recent = set(expected)  # round 0: every member
        if rnd > 0:
            with self._led() as led:
                prev = round_aggregate(led, self.campaign, rnd - 1)
            if prev is not None:
                recent = set(prev.body.get("participants") or [])
        while True:
            with self._led() as led:
                agg = round_aggregate(led, self.campaign, rnd)
                entries = round_weights_entries(led, self.campaign, rnd)
            held = [e for e in entries if self.store.has(str(e.body.get("blob")))]
            if self.c.min_peers:
                enough = len(held) >= self.c.min_peers
            else:  # every live member: all members, or (daemon running) those connected to it
                enough = set(await self._live(expected, gone_since, recent)) <= {_signer(e) for e in held}
            if agg is not None or enough or self.fabric.now() >= until:
                return held, agg
            for e in entries:  # block on the daemon's fetch of what is announced but not yet here
                if e not in held:
                    await self._await_blob(str(e.body.get("blob")), min(until, self.fabric.now() + 5))
                    break
            else:
                await self.fabric.sleep(POLL_S)

    def record(self, rnd: int, inputs: list[Entry], expected: list[str], reference: str) -> Entry:
        t = time.perf_counter()
        weights, (tensors, meta) = compute_round(self.store, inputs, weighting=self.c.weighting, q=self.c.q,
                                                 reference=reference)
        from atdnode.weights import save_weights

        blob = save_weights(self.store, tensors, meta)
        self._agg_s += time.perf_counter() - t
        publishers = sorted(_signer(e) for e in inputs)
        body = aggregate_round_body(campaign=self.campaign, rnd=rnd, weighting=self.c.weighting, q=self.c.q,
                                    reference=reference, inputs=[e.id.hex() for e in inputs], weights=weights,
                                    participants=publishers, missing=sorted(set(expected) - set(publishers)),
                                    store=self.store, blob=blob, model=self.cfg.to_dict())
        with self._led() as led:
            return bodies.append(led, self.ident.signer, "aggregate", body)

    async def run_round_async(self, rnd: int) -> RoundReport:
        with self._led() as led:
            existing = round_aggregate(led, self.campaign, rnd)
            expected = active_members(led)
        self._agg_s = 0.0
        start = await self.global_blob_async(rnd)
        rec, pub, agg, train_s = None, None, existing, 0.0
        c0 = self.fabric.now()
        if existing is None:  # train, publish, gather
            t = time.perf_counter()
            rec = self.train_round(rnd, start)
            train_s = time.perf_counter() - t
            pub = self.publish(rnd, rec)
            c0 = self.fabric.now()
            held, agg = await self.wait_inputs(rnd, expected)
            if agg is None:
                coordinator = choose_coordinator([_signer(e) for e in held]) == self.me
                if not coordinator:  # wait for the coordinator's entry, then stand in
                    until = self.fabric.now() + self.c.deadline
                    while agg is None and self.fabric.now() < until:
                        await self.fabric.sleep(POLL_S)
                        with self._led() as led:
                            agg = round_aggregate(led, self.campaign, rnd)
                if agg is None:
                    self.c.log(f"round {rnd}: recording the aggregate over {len(held)} inputs")
                    self.record(rnd, held, expected, start)
                    with self._led() as led:
                        agg = round_aggregate(led, self.campaign, rnd)
        blob = await self.adopt_async(agg)
        exchange = self.fabric.now() - c0 - (self._agg_s if self.fabric.wall_clock else 0.0)
        model_id = register_global(self.home, self.store, base=rec or self._base(), blob=blob, part="full", entry=agg,
                                   kind="global-round", extra_provenance={"campaign": self.campaign, "round": rnd})
        b = agg.body
        mine = pub.body["blob"] if pub is not None else None
        with self._led() as led:  # one ledger open for every input's body
            bodies_in = [e.body for h in b["inputs"] if (e := led.get(bytes.fromhex(h))) is not None]
        bytes_in = sum(int(body.get("size", 0)) for body in bodies_in if body.get("blob") != mine)
        return RoundReport(round=rnd, entry=agg.id.hex(), blob=blob, inputs=list(b["inputs"]), weights=list(b["weights"]),
                           missing=list(b.get("missing") or []), coordinator=_signer(agg) == self.me,
                           adopted=_signer(agg) != self.me, train_s=round(train_s, 3),
                           exchange_s=round(max(exchange, 0.0), 3), aggregate_s=round(self._agg_s, 3),
                           exchange_clock="wall" if self.fabric.wall_clock else "simulated",
                           bytes_out=int(pub.body["size"]) if pub is not None else 0,
                           bytes_in=bytes_in, metrics={"model": model_id, **({k: rec.metrics.get(k) for k in
                                                       ("accuracy", "robust_accuracy")} if rec else {})})

    def _base(self) -> ModelRecord:
        """A registry record for a round this node did not train in (it adopted the global)."""
        return ModelRecord(model=self.cfg.to_dict(), labels=self.labels, label_fp=self.label_fp, samples=0,
                           metrics={}, blobs={"full": self.init}, provenance={"data": self.c.data})

    async def run_async(self, on_round: Callable[[RoundReport], None] | None = None) -> list[RoundReport]:
        with self._led() as led:
            start = current_round(led, self.campaign)
        out = []
        for rnd in range(start, self.c.rounds):
            rep = await self.run_round_async(rnd)
            self.c.log(f"round {rnd}: global {rep.blob[:12]} over {len(rep.inputs)} inputs"
                       + (f", missing {', '.join(p[:12] for p in rep.missing)}" if rep.missing else ""))
            out.append(rep)
            if on_round:
                on_round(rep)
        return out
