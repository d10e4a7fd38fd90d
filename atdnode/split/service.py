"""The split-learning server role inside the node daemon (`atd node start --role ...`).

A node started with ``--role festa-server | pfesta-server | msd-server`` gets one
`SplitService` (see `atdnode.split.role_services`). It

* announces a signed ``service`` entry: role, algorithm, tasks, body config, schedule and
  the stream protocol id (`SPLIT_PROTOCOL`);
* serves `SPLIT_PROTOCOL`, one stream per client session (messages in `session.py`);
  a client is the authenticated remote peer id and must be a consortium member;
* runs the campaign (`campaign.py`): rounds with deadlines, per-task unification,
  FESTA's frozen-body phase 2, or MSD's single round ending in a ``weights`` entry;
* saves the protocol server (`protocols` save/load), the round board and the byte counter
  under ``HOME/split/server/<algorithm>/`` after every round, so a restarted node resumes.

Faults: a client whose stream breaks is dropped at once, one that stays silent is dropped
at the round deadline, one that sends a malformed frame gets an ``error`` message and
only its stream is closed (all recorded in the protocol server's ``dropped`` / ``events``).
The others go on. A dropped client may join again (``resume``) and continues next round.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import trio

from atdnode.node import NodeHome
from atdnode.split.campaign import Campaign
from atdnode.split.host import Session
from atdnode.split.msd_campaign import MSDCampaign
from atdnode.split.rounds import Board, Member
from atdnode.split.session import SPLIT_PROTOCOL, MalformedFrame, SplitChannel, meta_int
from atdnode.split.settings import SplitSettings
from atdnode.transport import FrameError, PeerLimits, Stream, TransportError, lease_or_reset
from ledger.errors import LedgerError
from protocols.comm_cost import ByteCounter
from protocols.split_state import SplitProtocolError

REFUSAL_FRAME = 64 << 10  # the split-protocol error frame sent to a non-member
log = logging.getLogger("atd.split")

ROLE_OF = {"festa": "festa-server", "pfesta": "pfesta-server", "msd": "msd-server"}


SPLIT_STREAMS_PER_PEER = 2  # live split streams one peer may hold ...
SPLIT_STREAMS_TOTAL = 512  # ... and all peers together


class SplitService:
    """A split server. `install(daemon)` registers the stream handler; `run(daemon)` runs
    the campaign in the daemon's nursery. Tests may pass ``settings`` explicitly. The
    campaign sees it as a `host.CampaignHost`."""

    def __init__(self, home: NodeHome, algorithm: str, *, settings: SplitSettings | None = None) -> None:
        if algorithm not in ROLE_OF:
            raise ValueError(f"unknown split algorithm {algorithm!r}")
        self.home, self.algorithm = home, algorithm
        self.settings = settings
        self.dir = Path(home.root) / "split" / "server" / algorithm
        self.counter = ByteCounter()
        self.sessions: dict[str, Session] = {}
        self.board: Board | None = None
        self.campaign: Campaign | MSDCampaign | None = None
        self.daemon: Any = None
        self.service_entry: str | None = None
        self.failed: str | None = None
        self.ready = trio.Event()  # state loaded, handler may admit clients
        # p-FESTA / MSD: the adopted `split_secret` entry (an id; the server cannot open it)
        # and the clients that asked for it before one was made (see `_secret`)
        self.secret_entry: str | None = None
        self.secret_askers: set[str] = set()
        # once a maker is named, the client list is closed: the maker seals the secret to the
        # clients accepted so far, and a later acceptance would make that secret invalid
        self.clients_closed = False
        self._adopting = trio.Lock()
        # awaited with the round number after each completed (and saved) round; tests and
        # monitors hook in here (a slow observer holds the next round back)
        self.round_observers: list = []
        self._stream_limits = PeerLimits(per_peer=SPLIT_STREAMS_PER_PEER, total=SPLIT_STREAMS_TOTAL)

    # ------------------------------------------------------------------ lifecycle

    def install(self, daemon: Any) -> None:
        self.daemon = daemon
        if self.settings is None:
            self.settings = SplitSettings.load(self.home)
        daemon.transport.set_stream_handler(SPLIT_PROTOCOL, self._handle_limited)

    async def run(self, daemon: Any) -> None:
        """Load or create the server state, announce the offer, run the campaign, then keep
        serving (evaluation, late questions) until the daemon stops."""
        self.daemon = daemon
        assert self.settings is not None, "install() first"
        self.board = Board(self.settings.total_rounds(self.algorithm))
        self.campaign = (MSDCampaign if self.algorithm == "msd" else Campaign)(self)
        try:
            await self.campaign.open_state()
        except Exception as e:  # the node keeps replicating; split clients are told why
            self.failed = f"split server state unusable: {e}"
            log.error("%s", self.failed)
            self.ready.set()
            await trio.sleep_forever()
        await self._announce()  # before admitting anyone: every offer names the signed entry
        self.secret_entry = await self.daemon.ledger.run(self._adopted)  # the server's signed adoption
        self.ready.set()
        try:
            await self.campaign.run()
        except Exception as e:  # keep the node alive; clients are told why
            self.failed = f"split campaign failed: {type(e).__name__}: {e}"
            log.exception("split campaign failed")
            for sess in list(self.sessions.values()):
                sess.dropped = self.failed
                sess.scope.cancel()
        await trio.sleep_forever()

    def _adopted(self, led) -> str | None:
        from atdnode.split.secret import acceptance, service_entry

        if self.algorithm == "festa" or self.service_entry is None:
            return None
        return acceptance(led, service_entry(led, self.service_entry))[1]

    @property
    def offer(self) -> dict[str, Any]:
        assert self.settings is not None
        return self.settings.offer(self.algorithm)

    async def _announce(self) -> None:
        """Append a signed `service` entry unless our latest one already says the same."""
        body = {"role": ROLE_OF[self.algorithm], "protocol": SPLIT_PROTOCOL, **self.offer}
        me = self.daemon.identity.public_key

        def latest(led):
            found = led.query(kind="service", author=me)
            return found[-1] if found else None

        for _ in range(30):
            try:
                last = await self.daemon.ledger.run(latest)
                if last is not None and last.body == body:
                    self.service_entry = last.id.hex()
                    return
                entry = await self.daemon.append("service", body)
                self.service_entry = entry.id.hex()
                log.info("announced %s service %s", self.algorithm, self.service_entry[:12])
                return
            except LedgerError as e:  # e.g. not admitted yet
                log.warning("could not announce the split service yet: %s", e)
                await trio.sleep(2.0)

    # ------------------------------------------------------------------ sessions

    async def _handle_limited(self, stream: Stream) -> None:
        """At most SPLIT_STREAMS_PER_PEER live split streams per peer (a reconnect may overlap
        the session it replaces); more are reset before a byte is read."""
        lease = await lease_or_reset(self._stream_limits, stream, "split")
        if lease is None:
            return
        with lease:
            await self._handle(stream)

    async def _handle(self, stream: Stream) -> None:
        """One client session: admission, the algorithm's message loop, evaluation, bye."""
        gate = getattr(self.daemon, "gate", None)  # members only, before the first frame is read
        if gate is not None and not gate.allows(stream.remote_peer):
            refused = gate.refuse(stream.remote_peer, "split session")  # typed, logged once per peer
            await SplitChannel(stream, self.counter, stream.remote_peer, side="server",
                               max_frame=REFUSAL_FRAME).send_error(str(refused))
            await stream.close()
            return
        await self.ready.wait()
        assert self.settings is not None and self.campaign is not None
        sess = Session(stream.remote_peer, SplitChannel(stream, self.counter, stream.remote_peer, side="server",
                                                        max_frame=self.settings.max_frame))
        try:
            with sess.scope:
                await self._session(sess)
        except (MalformedFrame, FrameError) as e:
            await self._fault(sess, f"malformed frame: {e}")
        except SplitProtocolError as e:
            await self._fault(sess, str(e))
        except trio.TooSlowError:
            await self._fault(sess, f"silent for {self.idle_timeout:.0f} s")
        except TransportError as e:
            if sess.admitted and not sess.clean and self.sessions.get(sess.client) is sess:
                await self.drop(sess.client, f"disconnected: {e}", current=sess)
        finally:
            if self.sessions.get(sess.client) is sess:
                del self.sessions[sess.client]
                assert self.board is not None
                self.board.ready.discard(sess.client)
                self.board.notify()
        if sess.scope.cancelled_caught and sess.dropped:
            await sess.channel.send_error(sess.dropped)
        elif sess.scope.cancelled_caught:  # replaced by a newer session of the same client
            await stream.reset()

    async def _session(self, sess: Session) -> None:
        ch = sess.channel
        first = await self.recv(sess, "info", "join")
        if first.meta["kind"] == "info":
            await ch.send("offer", None, {"offer": self.offer, "service_entry": self.service_entry})
            first = await self.recv(sess, "join", "bye", "secret")
            while first.meta["kind"] == "secret":
                await ch.send("secret_ok", None, await self._secret(sess, first))
                first = await self.recv(sess, "join", "bye", "secret")
            if first.meta["kind"] == "bye":
                sess.clean = True
                return
        if self.failed:
            raise SplitProtocolError(self.failed)
        assert self.campaign is not None
        welcome = await self.campaign.admit(sess, first)
        await ch.send("welcome", None, welcome)
        await self.campaign.serve(sess)

    async def _secret(self, sess: Session, frame) -> dict[str, Any]:
        """``secret {entry}`` -> ``secret_ok {entry, clients}`` (p-FESTA / MSD only).

        The server admits the campaign's clients and arbitrates which client-made embedder
        secret the campaign uses, seeing only entry ids and ciphertext. It first pulls the
        asker's ledger (its ``hello`` with its X25519 key, its ``split_join``, and its
        secret entry if it offers one). Without an offered entry: the asker must be an
        accepted client (`_accept`: the daemon signs its acceptance per ``[split] accept``);
        if no secret is adopted yet, the reply waits until ``clients`` members asked (or
        ``start_timeout``), so that whoever then makes the secret can seal it to all of
        them, naming one of them the maker (``maker``: the others ask again with ``wait``
        and get the maker's secret) and closing the client list. With one: a valid offered
        entry (`secret.check_secret_entry`) is adopted in a signed ``split_accept`` entry
        unless one was adopted already; every later asker is told the adopted one."""
        from atdnode.split.secret import SplitSecretError, adopt_body
        from atdnode.bodies import SPLIT_ACCEPT_KIND

        assert self.settings is not None and self.board is not None
        if self.algorithm == "festa":
            raise SplitProtocolError("FESTA has no embedder secret")
        await self.check_member(sess.client)
        await self.daemon.sync_with(sess.client, asked=True)  # its hello, even in a refusal back-off
        offered = frame.meta.get("entry")
        b = self.board
        if offered is None:
            await self._accept(sess.client)
            self.secret_askers.add(sess.client)
            b.notify()
            deadline = trio.current_time() + self.settings.start_timeout
            if frame.meta.get("wait"):  # not the named maker: wait for the maker's secret
                await b.wait(lambda: self.secret_entry is not None, deadline)
            else:
                await b.wait(lambda: self.secret_entry is not None or len(self.secret_askers) >= self.settings.clients,
                             deadline)
        elif self.secret_entry is None:
            sid, me = self.service_entry or "", self.daemon.identity.public_key
            async with self._adopting:  # one adopting entry: concurrent offers wait for it
                try:
                    eid, body = await self.daemon.ledger.run(lambda led: adopt_body(led, offered, sid, me))
                except SplitSecretError as e:
                    raise SplitProtocolError(str(e)) from None
                if body is not None:
                    await self.daemon.append(SPLIT_ACCEPT_KIND, body)
                if self.secret_entry is None:
                    self.secret_entry = eid
                    await trio.to_thread.run_sync(self.write_json, "secret.json", {"service": sid, "entry": eid})
                    log.info("campaign embedder secret: entry %s by %s", eid[:12], sess.client[-8:])
                    b.notify()
        maker = min(self.secret_askers) if self.secret_entry is None and self.secret_askers else None
        if maker is not None:
            self.clients_closed = True
        return {"entry": self.secret_entry, "clients": sorted(self.secret_askers), "maker": maker}

    async def _accept(self, client: str) -> None:
        """Make ``client`` an accepted client of the campaign, or refuse it (SplitProtocolError):
        it must have signed its ``split_join`` and announced its X25519 key; with
        ``[split] accept = "members"`` the daemon signs its acceptance, with "manual" only the
        operator's (`atd split accept`) counts. Once a maker is named, or a secret adopted,
        nobody more is accepted."""
        from atdnode.split.secret import SplitSecretError, accept_body, accepted, joined
        from atdnode.aggregation import announced_key
        from atdnode.bodies import SPLIT_ACCEPT_KIND
        from ledger import public_key_from_peer_id

        assert self.settings is not None
        sid, me, policy = self.service_entry or "", self.daemon.identity.public_key, self.settings.accept
        key = public_key_from_peer_id(client)
        closed = self.clients_closed

        def decide(led) -> dict | None:
            if key in accepted(led, sid):
                return None
            if key not in joined(led, sid):
                raise SplitSecretError(f"{client[-8:]} has not signed its split_join of this campaign")
            if announced_key(led, key) is None:
                raise SplitSecretError(f"{client[-8:]} has announced no X25519 key: no secret can be sealed to it")
            if closed:
                raise SplitSecretError("this campaign's client list is closed: its embedder secret is made for the "
                                       "clients accepted before; the server's operator can start a new campaign")
            if policy == "manual":
                raise SplitSecretError(f"the server's operator has not accepted {client} into this campaign "
                                       f"(on the server: atd split accept {client})")
            return accept_body(led, sid, me, [client])

        try:
            body = await self.daemon.ledger.run(decide)
        except SplitSecretError as e:
            raise SplitProtocolError(str(e)) from None
        if body is not None:
            await self.daemon.append(SPLIT_ACCEPT_KIND, body)
            log.info("accepted split client %s into campaign %s", client[-8:], sid[:12])

    @property
    def idle_timeout(self) -> float:
        """Longest a client may keep a stream silent (loading data, evaluating...); stalls
        inside a round are caught earlier by the round deadline."""
        assert self.settings is not None
        return max(self.settings.round_timeout, self.settings.start_timeout)

    async def recv(self, sess: Session, *kinds: str):
        """Receive from a client within the idle limit (else trio.TooSlowError)."""
        with trio.fail_after(self.idle_timeout):
            return await sess.channel.recv(*kinds)

    async def _fault(self, sess: Session, reason: str) -> None:
        """A client broke the protocol: record it, tell it, close only its stream."""
        log.info("split client %s: %s", sess.client[-8:], reason)
        if sess.admitted and self.sessions.get(sess.client) is sess:
            await self.drop(sess.client, reason, current=sess)
        await sess.channel.send_error(reason)

    async def drop(self, client: str, reason: str, *, current: Session | None = None) -> None:
        """Drop ``client`` from the campaign (recorded by the protocol server), cancel its
        session unless it is the caller, and wake the coordinator."""
        assert self.board is not None and self.campaign is not None
        await self.campaign.drop_member(client, reason)
        b = self.board
        b.ready.discard(client)
        b.round_members.discard(client)
        b.submitted.pop(client, None)
        b.downloads.pop(client, None)
        sess = self.sessions.get(client)
        if sess is not None and sess is not current:
            sess.dropped = f"dropped: {reason}"
            sess.scope.cancel()
        b.notify()
        log.info("dropped split client %s: %s", client[-8:], reason)

    # ------------------------------------------------------------------ persistence

    def write_json(self, name: str, data: Any) -> None:
        """Atomic JSON file under the service directory (worker thread)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / name
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read_json(self, name: str) -> Any | None:
        try:
            return json.loads((self.dir / name).read_text())
        except FileNotFoundError:
            return None

    async def check_member(self, client: str) -> None:
        """SplitProtocolError unless ``client`` is a (non-revoked) member of the consortium."""
        from ledger import public_key_from_peer_id

        try:
            pk = public_key_from_peer_id(client)
        except ValueError:
            raise SplitProtocolError(f"{client} is not an Ed25519 peer id") from None
        if not await self.daemon.ledger.run(lambda led: led.membership().is_member(pk)):
            raise SplitProtocolError(f"{client} is not a member of this consortium")

    def member(self, client: str) -> Member:
        assert self.board is not None
        m = self.board.members.get(client)
        if m is None:
            raise SplitProtocolError(f"client {client} has not joined")
        return m

    def join_fields(self, frame) -> tuple[str, int, int | None, bool]:
        """(task, num_samples, rounds or None, resume) of a ``join`` message, validated."""
        task = frame.meta.get("task")
        if not isinstance(task, str):
            raise SplitProtocolError("join: task must be a string")
        num = meta_int(frame, "num_samples", low=1)
        assert self.settings is not None
        if num > self.settings.max_samples:
            raise SplitProtocolError(f"join: {num} samples exceed this server's limit of {self.settings.max_samples}")
        rounds = frame.meta.get("rounds")
        if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1):
            raise SplitProtocolError("join: rounds must be a positive integer or absent")
        return task, num, rounds, bool(frame.meta.get("resume", False))
