"""Serverless training rounds on the fabric (`atd rounds`): FedAvg, FedWAvg or a robust
aggregator, optionally adversarial.

The runner. What fixes a campaign, the entries a round writes and the checks every member
runs before it adopts a global model are in `atdnode.rounds.rules`; how the runner reaches
its daemon and clock is a `atdnode.rounds.fabric.Fabric`.

Round t on each member: if round t is already over (a *closed* aggregate: final and a
majority of its participants trained round t+1 from it), adopt it (a late member); else
train from global t-1 (`atdnode.learning.training.train`, the library behind `atd train`),
publish, wait until the inputs of every live member (all members, or those in
`RoundsConfig.members` when given: a plan's rounds step gives its members that did not
decline; not one that signed an input of a later round; with a daemon, not those
disconnected from it for `absent_grace` s, nor, at the peer-set target, members outside
the set that sat out the previous round: `RoundRunner._live`) or of --min-peers members
are held, or the deadline passes, then adopt an aggregate that narrows nothing this node
held in time, or record the aggregate over every input it holds (the coordinator, smallest
publishing peer id, at once; the others after one more deadline, or at once when some
aggregate left out an input they held; a coordinator gone for `absent_grace` s is passed
over for the next publisher). The rules and how two members' views converge are in the
module doc of `atdnode.rounds.rules`.

Adoption always recomputes: every aggregate, ours aside, is verified here from its
inputs (with the campaign's aggregator, `protocols.rounds.AGGREGATORS`) before its global
model is used (`verify_round`, also reached by `atd aggregate --verify`), even when its
blob is already held; its input entries and blobs are awaited until the deadline (gossip
brings entries of different authors in any order) and an aggregate whose inputs never
arrive is not adopted. A restarted node resumes one past the last round with a final
aggregate.

The loop is async, one implementation: `run`, `run_round`, `global_blob` and `adopt` are
coroutines. The CLI runs them under `trio.run` with a `ControlFabric` (control socket, wall
clock); netsim runs many in one trio run with its in-memory fabric (`netsim.fat.MemFabric`,
simulated clock). Every rule (inputs, coordinator, weights, verification) is the same code
on both.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from atdnode import bodies
from atdnode.aggregation import register_global
from atdnode.blobs import BlobStore
from atdnode.errors import AtdError
from atdnode.node import NodeHome, NodeIdentity
from atdnode.learning import ModelConfig, TrainOptions, train
from atdnode.models import ModelRecord
from atdnode.rounds.rules import (
    RoundsError,
    absent_inputs,
    active_members,
    aggregate_round_body,
    campaign_id,
    closed,
    compute_round,
    current_round,
    init_blob,
    moved_past,
    narrows,
    round_aggregate,
    round_candidates,
    round_cosines,
    round_inputs,
    round_rule,
    round_weights_entries,
    signer as _signer,
    verify_round,
    weights_round_body,
)
from atdnode.rounds.fabric import ControlFabric, Fabric
from ledger import Entry, Ledger, LedgerError
from protocols.rounds import AGGREGATORS, choose_coordinator

POLL_S = 0.5
MAX_SWITCHES = 3  # times one round is redone because round t-1 closed on another global


class _Superseded(Exception):
    """Round t-1 closed on a global other than the one this node trained round t from."""


@dataclass
class RoundsConfig:
    """One member's view of a rounds campaign (`atd rounds`): its data, the shared model shape,
    rounds and the aggregation rule. Members with the same round-0 blob, weighting, q and name
    are one campaign (`round_rules.campaign_id`)."""

    data: str
    cfg: ModelConfig
    rounds: int
    weighting: str = "fedwavg"  # the aggregator (protocols.rounds.AGGREGATORS; `atd rounds --aggregator`)
    byzantine: int = 1  # f, the hostile members a robust aggregator is sized for
    q: float = 10.0  # FedWAvg's softmax scale: protocols.fedwavg.ROUNDS_Q, chosen by measurement
    local_epochs: int = 1
    batch_size: int = 16
    lr: float | None = None
    optimizer: str = "adamw"  # "sgd": the FedWAvg paper's local SGD, momentum 0.9 (atdnode.learning.trainer)
    lr_decay: float = 0.0  # sgd: the rate drops by this fraction per local epoch, counted across rounds
    seed: int = 0
    deadline: float = 120.0  # seconds to wait for the round's inputs after publishing
    min_peers: int | None = None  # None: every live member
    members: frozenset[str] | None = None  # peer ids waited for (None: every active member); the others are named missing
    absent_grace: float = 20.0  # a member not connected to our daemon this long is not waited for
    name: str = ""
    batch_transform: object | None = None  # atdnode.learning.train_options.AdversarialTransform
    init_state: dict | None = None  # shared initial weights (default: a fresh model from `seed`)
    device: str | None = None  # local training's device (atdnode.learning.device rule); averaging stays on the CPU
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
    cosines: list[float] | None = None  # fedwavg: the c_i behind `weights` (as recorded)

    def to_json(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------- the loop

class RoundRunner:
    """Runs a campaign's rounds for one node (see the module docstring)."""

    def __init__(self, home: NodeHome, config: RoundsConfig, *, fabric: Fabric | None = None) -> None:
        if config.weighting not in AGGREGATORS:
            raise RoundsError(f"--aggregator {config.weighting!r}: choose from {', '.join(AGGREGATORS)}")
        if isinstance(config.byzantine, bool) or not isinstance(config.byzantine, int) or config.byzantine < 0:
            raise RoundsError(f"--byzantine must be a count >= 0, got {config.byzantine!r}")
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
        self.robust = AGGREGATORS[config.weighting].robust
        self.campaign = campaign_id(self.init, config.weighting, config.q, config.name,
                                    config.byzantine if self.robust else None)
        self._globals: dict[int, str] = {}  # round -> the global model adopted for it
        self._held: dict[int, set[str]] = {}  # round -> authors of the valid inputs held when its wait ended
        self._narrowing: set[bytes] = set()  # aggregates not adopted because they narrow the round (logged once)
        self._verified: dict[bytes, str] = {}  # aggregate entry id -> its recomputed global blob
        self._rejected: dict[bytes, str] = {}  # aggregate entry id -> why it was not adopted

    # -- ledger helpers
    def _led(self) -> Ledger:
        return Ledger.open(self.home.ledger_db)

    # -- the global models
    async def global_blob(self, rnd: int) -> str:
        """The global model entering round `rnd` (round 0: the shared init): the first of round
        rnd-1's candidate aggregates that verifies here (`protocols.rounds.candidate_order`);
        once adopted it is kept (`run_round` re-reads it when round rnd starts, so
        members that recorded competing aggregates converge on one)."""
        if rnd == 0:
            return self.init
        if rnd - 1 not in self._globals and await self._pick_global(rnd - 1) is None:
            raise RoundsError(f"round {rnd - 1} has no aggregate that verifies here yet")
        return self._globals[rnd - 1]

    async def adopt(self, agg: Entry) -> str:
        """Hold round aggregate `agg`'s global blob: always recomputed here from its inputs
        (entries and blobs awaited until the deadline) against the global model this node
        holds for the previous round, even when the named blob is already held. Raises
        AggregateError / RoundsError when it does not verify or its inputs never arrive."""
        await self._adopt(agg, self.fabric.now() + self.c.deadline)
        return self._globals[agg.body["round"]]

    async def pick(self, rnd: int, eligible: Callable[[Ledger, Entry], bool], until: float | None = None) -> Entry | None:
        """Adopt round `rnd`'s first candidate aggregate that is `eligible` and verifies here;
        None if none does. A candidate that fails is logged and not tried again this run.
        `until`: one deadline for fetching the inputs of all candidates (default: the round's)."""
        until = self.fabric.now() + self.c.deadline if until is None else until
        with self._led() as led:
            cands = [e for e in round_candidates(led, self.campaign, rnd)
                     if e.id not in self._rejected and eligible(led, e)]
        for agg in cands:
            try:
                await self._adopt(agg, until)
                return agg
            except (AtdError, LedgerError) as exc:  # AggregateError, RoundsError, BodyError, ...: skip it
                self._rejected[agg.id] = str(exc)
                self.c.log(f"round {rnd}: aggregate {agg.id.hex()[:12]} by {_signer(agg)[:12]} not adopted: {exc}")
        return None

    async def _adopt(self, agg: Entry, until: float) -> None:
        rnd = agg.body.get("round")
        if agg.body.get("campaign") != self.campaign or type(rnd) is not int or rnd < 0:
            raise RoundsError(f"aggregate {agg.id.hex()[:12]} is not a round of this campaign")
        name, q, f = round_rule(agg.body)
        if name != self.c.weighting or q != float(self.c.q) or (self.robust and f != self.c.byzantine):
            raise RoundsError(f"aggregate {agg.id.hex()[:12]} is computed with {name} (q={q:g}, f={f}), not the "
                              f"campaign's {self.c.weighting}")
        reference = await self.global_blob(rnd)
        if agg.id not in self._verified:
            while True:  # its input entries may reach this ledger after it (gossip has no order across authors)
                with self._led() as led:
                    absent = absent_inputs(led, agg)
                    inputs = [] if absent else round_inputs(led, agg, reference)  # the checks that need no blob
                if not absent:
                    break
                if self.fabric.now() >= until:
                    raise RoundsError(f"aggregate {agg.id.hex()[:12]}: input {absent[0][:16]} never reached this ledger")
                await self.fabric.sleep(POLL_S)
            for e in inputs:
                if not await self._await_blob(str(e.body.get("blob")), until):
                    raise RoundsError(f"aggregate {agg.id.hex()[:12]}: the blob of input {e.id.hex()[:16]} "
                                      "could not be fetched")
            t = time.perf_counter()
            with self._led() as led:
                self._verified[agg.id] = verify_round(led, self.store, agg, reference)
            self._agg_s += time.perf_counter() - t
        self._globals[rnd] = self._verified[agg.id]

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

        With a bounded peer set a daemon at its peer target is not connected to
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

    async def _coordinator(self, publishers: list[str], gone_since: dict[str, float]) -> str:
        """Who records the round's aggregate: the smallest of `publishers` (the authors of the
        inputs held) that `_live` still waits for, this node when none is. Every publisher
        counts as recent (it published this round), so at the peer target one outside the
        peer set is still waited for; below it one disconnected for the grace is not."""
        live = await self._live(publishers, gone_since, set(publishers))
        return choose_coordinator(live or [self.me])

    # -- one round
    def train_round(self, rnd: int, start: str) -> ModelRecord:
        opts = TrainOptions(epochs=self.c.local_epochs, batch_size=self.c.batch_size, lr=self.c.lr,
                            optimizer=self.c.optimizer, lr_decay=self.c.lr_decay, epoch_offset=rnd * self.c.local_epochs,
                            warmup_epochs=0.0, init_from=start, seed=self.c.seed * 1000 + rnd, augment=False,
                            device=self.c.device, epoch_eval=False, plots=False, batch_transform=self.c.batch_transform,
                            extra_provenance={"campaign": self.campaign, "round": rnd, "start": start})
        return train(self.home, self.c.data, self.cfg, opts)

    def _mine(self, rnd: int, start: str) -> Entry | None:
        """This node's input of round `rnd` trained from `start`, if published (a restart)."""
        with self._led() as led:
            return next((e for e in round_weights_entries(led, self.campaign, rnd, start) if _signer(e) == self.me),
                        None)

    def publish(self, rnd: int, rec: ModelRecord) -> Entry:
        start = str(rec.provenance["start"])
        mine = self._mine(rnd, start)
        if mine is not None:  # a restart after publishing: do not publish twice
            return mine
        body = weights_round_body(self.store, rec.blobs["full"], rec, campaign=self.campaign, rnd=rnd, start=start)
        with self._led() as led:
            return bodies.append(led, self.ident.signer, "weights", body)

    def _admissible(self, rnd: int) -> Callable[[Ledger, Entry], bool]:
        """Aggregates of round `rnd` this node may adopt: none that names as missing an author
        whose input it held when its wait ended (`rules.narrows`; no constraint for a round it
        did not wait in). Those refused are logged once."""
        held = self._held.get(rnd, set())

        def ok(_led: Ledger, e: Entry) -> bool:
            left_out = narrows(e, held)
            if left_out and e.id not in self._narrowing:
                self._narrowing.add(e.id)
                self.c.log(f"round {rnd}: aggregate {e.id.hex()[:12]} by {_signer(e)[:12]} not adopted: it names as "
                           f"missing {', '.join(p[:12] for p in left_out)}, whose input reached this node in time")
            return not left_out
        return ok

    async def _pick_global(self, rnd: int, until: float | None = None) -> Entry | None:
        """Round `rnd`'s global: a closed aggregate if one verifies, else the first admissible
        one that does (module doc of `atdnode.rounds.rules`)."""
        return await self.pick(rnd, closed, until) or await self.pick(rnd, self._admissible(rnd), until)

    def _narrowed(self, rnd: int) -> bool:
        """Whether some aggregate of round `rnd` narrows it here (then the full one is recorded at once)."""
        ok = self._admissible(rnd)
        with self._led() as led:
            return any(not ok(led, e) for e in round_candidates(led, self.campaign, rnd) if e.id not in self._rejected)

    def _superseded(self, rnd: int) -> bool:
        """Whether round rnd-1 closed on a global other than the one this node trains round `rnd` from."""
        if rnd == 0 or rnd - 1 not in self._globals:
            return False
        with self._led() as led:
            return any(closed(led, e) and e.body.get("blob") != self._globals[rnd - 1]
                       for e in round_candidates(led, self.campaign, rnd - 1) if e.id not in self._rejected)

    async def wait_inputs(self, rnd: int, expected: list[str], start: str) -> list[Entry]:
        """Until every live member's input (trained from `start`) is held (or --min-peers
        members'), the round closed, or the deadline: the held inputs. A member that signed
        an input of a later round is not waited for (`rules.moved_past`). An aggregate
        recorded meanwhile does not end the wait (module doc of `atdnode.rounds.rules`,
        rule 1)."""
        until = self.fabric.now() + self.c.deadline
        if self.c.members is not None:  # members outside the campaign's set are not waited for
            expected = [p for p in expected if p in self.c.members]
        gone_since: dict[str, float] = {}
        recent = set(expected)  # round 0: every member
        if rnd > 0:
            with self._led() as led:
                prev = round_aggregate(led, self.campaign, rnd - 1)
            if prev is not None:
                recent = set(prev.body.get("participants") or [])
        while True:
            if self._superseded(rnd):
                raise _Superseded()
            with self._led() as led:
                entries = round_weights_entries(led, self.campaign, rnd, start)
                held = [e for e in entries if self.store.has(str(e.body.get("blob")))]
                over = any(closed(led, a) for a in round_candidates(led, self.campaign, rnd) if a.id not in self._rejected)
            if self.c.min_peers:
                enough = len(held) >= self.c.min_peers
            else:  # every live member: all members, or (daemon running) those connected to it
                awaited = set(await self._live(expected, gone_since, recent)) - {_signer(e) for e in held}
                if awaited:  # one that resumed past this round will not publish its input
                    with self._led() as led:
                        awaited -= moved_past(led, self.campaign, rnd)
                enough = not awaited
            if over or enough or self.fabric.now() >= until:
                self._held[rnd] = {_signer(e) for e in held}
                return held
            for e in entries:  # block on the daemon's fetch of what is announced but not yet here
                if e not in held:
                    await self._await_blob(str(e.body.get("blob")), min(until, self.fabric.now() + 5))
                    break
            else:
                await self.fabric.sleep(POLL_S)

    def record(self, rnd: int, inputs: list[Entry], expected: list[str], reference: str) -> Entry:
        t = time.perf_counter()
        weights, (tensors, meta) = compute_round(self.store, inputs, weighting=self.c.weighting, q=self.c.q,
                                                 reference=reference, byzantine=self.c.byzantine)
        cosines = round_cosines(self.store, inputs, reference) if self.c.weighting == "fedwavg" else None
        if cosines is not None:
            self.c.log(f"round {rnd}: fedwavg q={self.c.q:g} cosines {[round(c, 5) for c in cosines]} "
                       f"-> weights {[round(w, 4) for w in weights]}")
        from atdnode.models import save_weights

        blob = save_weights(self.store, tensors, meta)
        self._agg_s += time.perf_counter() - t
        publishers = sorted(_signer(e) for e in inputs)
        body = aggregate_round_body(campaign=self.campaign, rnd=rnd, weighting=self.c.weighting, q=self.c.q,
                                    reference=reference, inputs=[e.id.hex() for e in inputs], weights=weights,
                                    participants=publishers, missing=sorted(set(expected) - set(publishers)),
                                    store=self.store, blob=blob, model=self.cfg.to_dict(),
                                    cosines=cosines, byzantine=self.c.byzantine)
        with self._led() as led:
            entry = bodies.append(led, self.ident.signer, "aggregate", body)
        self._verified[entry.id] = blob  # computed here
        return entry

    async def settle(self, rnd: int, held: list[Entry], expected: list[str], start: str) -> Entry:
        """After the wait: adopt a closed or admissible aggregate (`_pick_global`), else record
        the aggregate over every valid input held -- at once as the coordinator or when some
        aggregate narrowed the round, else once this node becomes the coordinator or after one
        more deadline for the coordinator's. The coordinator is the smallest publisher held
        still live (`_coordinator`): one that went away before its aggregate reached this
        node is passed over after the grace, not waited for until the deadline."""
        agg = await self._pick_global(rnd)
        publishers = [_signer(e) for e in held]
        gone_since: dict[str, float] = {}
        until = self.fabric.now() + self.c.deadline
        while agg is None and self.fabric.now() < until and not self._narrowed(rnd):
            if await self._coordinator(publishers, gone_since) == self.me:
                break
            if self._superseded(rnd):
                raise _Superseded()
            await self.fabric.sleep(POLL_S)
            agg = await self._pick_global(rnd, until)
        if agg is None:
            with self._led() as led:
                inputs = [e for e in round_weights_entries(led, self.campaign, rnd, start)
                          if self.store.has(str(e.body.get("blob")))]
            self.c.log(f"round {rnd}: recording the aggregate over {len(inputs)} inputs")
            self.record(rnd, inputs, expected, start)
            agg = await self._pick_global(rnd)
        if agg is None:
            raise RoundsError(f"round {rnd}: no aggregate verifies here")
        return agg

    async def _play(self, rnd: int, expected: list[str]) -> tuple[Entry, ModelRecord | None, Entry | None, float, float]:
        """Round `rnd` from the global entering it: (aggregate, own record, own input, train
        seconds, when the exchange began). Raises _Superseded (module doc, rule 3)."""
        start = await self.global_blob(rnd)
        rec, train_s = None, 0.0
        c0 = self.fabric.now()
        agg = await self.pick(rnd, closed)  # the round is over (we were late): adopt, do not train it
        if agg is not None:
            return agg, None, None, 0.0, c0
        pub = self._mine(rnd, start)  # a restart after publishing: not trained again
        if pub is None:
            t = time.perf_counter()
            rec = self.train_round(rnd, start)
            train_s = time.perf_counter() - t
            await self.fabric.trained(train_s)
            pub = self.publish(rnd, rec)
        c0 = self.fabric.now()
        held = await self.wait_inputs(rnd, expected, start)
        return await self.settle(rnd, held, expected, start), rec, pub, train_s, c0

    async def run_round(self, rnd: int) -> RoundReport:
        with self._led() as led:
            expected = active_members(led)
        self._agg_s = 0.0
        self._globals.pop(rnd - 1, None)  # re-read round rnd-1 before training on it (a larger one may be here now)
        for switch in range(MAX_SWITCHES + 1):
            try:
                agg, rec, pub, train_s, c0 = await self._play(rnd, expected)
                break
            except _Superseded:
                if switch == MAX_SWITCHES:
                    raise RoundsError(f"round {rnd}: round {rnd - 1} closed on another global {switch + 1} times")
                self.c.log(f"round {rnd}: round {rnd - 1} closed on another global model; redoing round {rnd} from it")
                self._globals.pop(rnd - 1, None)
        blob = self._globals[rnd]
        exchange = self.fabric.now() - c0 - (self._agg_s if self.fabric.wall_clock else 0.0)
        model_id = register_global(self.home, self.store, base=rec or self._base(), blob=blob, part="full", entry=agg,
                                   kind="global-round", extra_provenance={"campaign": self.campaign, "round": rnd})
        b = agg.body
        mine = pub.body["blob"] if pub is not None else None
        with self._led() as led:  # one ledger open for every input's body
            bodies_in = [e.body for h in b["inputs"] if (e := led.get(h)) is not None]
        bytes_in = sum(int(body.get("size", 0)) for body in bodies_in if body.get("blob") != mine)
        return RoundReport(round=rnd, entry=agg.id.hex(), blob=blob, inputs=list(b["inputs"]), weights=list(b["weights"]),
                           missing=list(b.get("missing") or []), coordinator=_signer(agg) == self.me,
                           adopted=_signer(agg) != self.me, train_s=round(train_s, 3),
                           exchange_s=round(max(exchange, 0.0), 3), aggregate_s=round(self._agg_s, 3),
                           exchange_clock="wall" if self.fabric.wall_clock else "simulated",
                           bytes_out=int(pub.body["size"]) if pub is not None else 0,
                           bytes_in=bytes_in, cosines=b.get("cosines"), metrics={"model": model_id, **({k: rec.metrics.get(k) for k in
                                                       ("accuracy", "robust_accuracy")} if rec else {})})

    def _base(self) -> ModelRecord:
        """A registry record for a round this node did not train in (it adopted the global)."""
        return ModelRecord(model=self.cfg.to_dict(), labels=self.labels, label_fp=self.label_fp, samples=0,
                           metrics={}, blobs={"full": self.init}, provenance={"data": self.c.data})

    async def run(self, on_round: Callable[[RoundReport], None] | None = None) -> list[RoundReport]:
        """Rounds from the ledger's current round to the last; returns what this run did."""
        with self._led() as led:
            start = current_round(led, self.campaign)
        out = []
        for rnd in range(start, self.c.rounds):
            rep = await self.run_round(rnd)
            self.c.log(f"round {rnd}: global {rep.blob[:12]} over {len(rep.inputs)} inputs"
                       + (f", missing {', '.join(p[:12] for p in rep.missing)}" if rep.missing else ""))
            out.append(rep)
            if on_round:
                on_round(rep)
        return out
