"""`atd split join`: take part in a split-learning campaign as a client, without a daemon.

The client starts a transient transport with the node's own identity (so the server sees
its consortium peer id), dials the server (addresses from ``--server-addr`` or from the
server's signed ``hello`` entry in the local ledger, or the config's bootstrap list),
pulls the ledger from it (so the local ledger learns the ``service`` — and for MSD the
``weights`` — entries), asks for the offer and checks it against the signed ``service``
entry, for p-FESTA / MSD obtains the campaign's embedder secret (`secret.py`; made here
if no client made one yet), loads its data, and runs its role (`roles.py`). If the stream breaks it dials
again (until ``reconnect_timeout``) and resumes with the same learning state. At the end
it evaluates the task metric through the server and writes a comm record (measured bytes
per direction and kind + the paper's CostParams) under ``HOME/split/records/``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from atdnode.blobs import BlobStore
from atdnode.node import NodeConfig, NodeHome, NodeIdentity
from atdnode.data import load_dataset
from atdnode.data import require_classes
from atdnode.learning import resolve_device
from atdnode.errors import AtdError
from atdnode.retry import retry
from atdnode.replication import SYNC_PROTOCOL, LedgerAccess, ledger_guard, pull, serve_sync
from atdnode.split.report import make_record, write_record
from atdnode.split.roles import ROLES, Task, prepare
from atdnode.split.secret import (acceptance, check_adopted, create_secret, ensure_hello, ensure_joined, open_secret,
                                  service_entry)
from atdnode.split.session import SPLIT_PROTOCOL, RemoteError, SplitChannel
from atdnode.transport import Stream, Transport, TransportError
from ledger import Ledger, public_key_from_peer_id
from ledger.errors import LedgerError
from protocols.comm_cost import ByteCounter
from protocols.split_parts import TaskSpec, split_config
from protocols.split_state import SplitError

log = logging.getLogger("atd.split.client")


class SplitJoinError(AtdError):
    """A split session could not be run or completed; the message says why."""


@dataclass
class JoinOptions:
    """`atd split join` options (see the CLI help for each)."""

    server: str
    task: str
    data: str
    server_addrs: list[str] = field(default_factory=list)
    rounds: int | None = None
    seed: int = 0
    lr: float | None = None
    evaluate: bool = True
    test_data: str | None = None  # default: the test split of `data`
    sync: bool = True
    permute: bool = True
    reconnect_timeout: float = 60.0
    read_timeout: float = 600.0  # the server may hold a reply until a round opens / MSD trains
    finetune_steps: int = 100
    finetune_lr: float = 2e-3
    compare_scratch: bool = False
    # simulation only (netsim): draw the embedder secret this node may make from this seed,
    # so that a scenario's MSD base is reproducible; None (OS randomness) in any deployment
    secret_seed: int | None = None


@dataclass
class JoinResult:
    record: dict[str, Any]
    path: Path

    @property
    def metrics(self) -> dict[str, float]:
        return self.record["metrics"]


def server_addresses(home: NodeHome, server: str, extra: list[str] = ()) -> list[str]:
    """Where to dial ``server``: explicit addresses first, then its latest signed ``hello``,
    then matching bootstrap entries of the config. SplitJoinError if none is known."""
    try:
        pk = public_key_from_peer_id(server)
    except ValueError:
        raise SplitJoinError(f"{server!r} is not a peer id") from None
    for a in extra:
        if not a.endswith(f"/p2p/{server}"):
            raise SplitJoinError(f"--server-addr {a} does not end with /p2p/{server}")
    out = list(extra)
    led = Ledger.open(home.ledger_db)
    try:
        hellos = led.query(kind="hello", author=pk)
    finally:
        led.close()
    if hellos and isinstance(hellos[-1].body.get("addrs"), list):
        out += [a for a in hellos[-1].body["addrs"] if isinstance(a, str)]
    out += [a for a in NodeConfig.load(home).bootstrap if a.endswith(f"/p2p/{server}")]
    out = list(dict.fromkeys(out))
    if not out:
        raise SplitJoinError(f"no address known for server {server}: pass --server-addr MULTIADDR "
                             "(or let a daemon sync the ledger so it holds the server's hello entry)")
    return out


class _Link:
    """Dial the server and open split streams, retrying until ``timeout``."""

    def __init__(self, transport: Transport, server: str, addrs: list[str], timeout: float) -> None:
        self.transport, self.server, self.addrs, self.timeout = transport, server, addrs, timeout

    async def _connect(self) -> None:
        if self.server in self.transport.peers():
            return
        errors = []
        for a in self.addrs:
            try:
                await self.transport.connect(a)
                return
            except TransportError as e:
                errors.append(f"{a}: {e}")
        raise TransportError("; ".join(errors) or "no address")

    async def open(self, protocol: str = SPLIT_PROTOCOL) -> Stream:
        async def attempt() -> Stream:
            await self._connect()
            return await self.transport.open_stream(self.server, protocol)

        try:  # back off between dials: 0.2 s doubling to 2 s, until the timeout
            return await retry(attempt, base=0.2, cap=2.0, deadline=trio.current_time() + self.timeout,
                               retry_on=(TransportError,))
        except TransportError as e:
            raise SplitJoinError(f"cannot reach split server {self.server}: {e}") from None


async def _sync(link: _Link, ledger: LedgerAccess) -> None:
    """Pull the server's ledger (best effort: the session does not depend on it)."""
    try:
        with trio.fail_after(30):
            await pull(await link.open(SYNC_PROTOCOL), ledger)
    except (TransportError, SplitJoinError, trio.TooSlowError, LedgerError) as e:
        log.info("ledger sync with the server failed: %s", e)


async def _verified_entry(link: _Link, ledger: LedgerAccess, server: str, offer: dict[str, Any],
                          named: str | None) -> str | None:
    """Check the offer against the server's signed ``service`` entry ``named`` (pulled again
    if the local ledger lacks it); returns its id, or None when none was named."""
    if named is None:
        return None
    if not isinstance(named, str):
        raise SplitJoinError("the server named a malformed service entry id")

    def has(led: Ledger) -> bool:
        try:
            return led.get(named) is not None
        except ValueError:
            raise SplitJoinError(f"the server named a malformed service entry id {named!r:.80}") from None

    if not await ledger.run(has):
        await _sync(link, ledger)
    return await ledger.run(lambda led: _check_offer(led, server, offer, named))


def _check_offer(ledger: Ledger, server: str, offer: dict[str, Any], named: str) -> str:
    """SplitJoinError unless entry ``named`` is the server's service entry and says what the offer says."""
    entry = ledger.get(named)
    if entry is None or entry.kind != "service" or entry.author != public_key_from_peer_id(server):
        raise SplitJoinError(f"could not verify the server's signed service entry {named[:12]}")
    body = entry.body
    for key in ("algorithm", "tasks", "body", "total_rounds", "steps_per_round", "unifying_rounds",
                "part_weighting", "head", "pos_embed"):
        if body.get(key) != offer.get(key):
            raise SplitJoinError(f"the server's offer differs from its signed service entry in {key!r}")
    return entry.id.hex()


async def run_join(home: NodeHome, transport: Transport, opts: JoinOptions) -> JoinResult:
    """One client session over a running ``transport`` (whose peer id is this node's)."""
    ident = NodeIdentity.load(home)
    if transport.peer_id != ident.peer_id:
        raise SplitJoinError("the transport must run with this node's identity")
    addrs = server_addresses(home, opts.server, opts.server_addrs)
    link = _Link(transport, opts.server, addrs, opts.reconnect_timeout)
    ledger = LedgerAccess(Ledger.open(home.ledger_db))
    counter, started = ByteCounter(), time.time()
    transport.set_stream_handler(  # daemons pull from peers; members only (atdnode.replication.access)
        SYNC_PROTOCOL, ledger_guard(lambda s: serve_sync(s, ledger), ledger, "ledger sync"))
    try:
        if opts.sync:
            await _sync(link, ledger)
        stream = await link.open()
        ch = SplitChannel(stream, counter, ident.peer_id, side="client", max_frame=64 << 20,
                          read_timeout=opts.read_timeout)
        try:
            await ch.send("info")
            offer_msg = (await ch.recv("offer")).meta
            offer, named = offer_msg.get("offer"), offer_msg.get("service_entry")
            if not isinstance(offer, dict) or offer.get("algorithm") not in ROLES:
                raise SplitJoinError(f"the server made no usable offer: {offer!r:.200}")
            secretive = offer["algorithm"] in ("pfesta", "msd")
            entry = await _verified_entry(link, ledger, opts.server, offer,
                                          named if opts.sync or secretive else None)
            secret, state = await _obtain_secret(ch, link, ledger, ident, entry, offer, opts.secret_seed) if secretive else (None, None)
            role = await trio.to_thread.run_sync(_make_role, home, ident.peer_id, offer, opts, state)
            if secret is not None:
                role.out.extra["secret_entry"] = secret
            log.info("joining %s server %s for task %s with %d samples", offer["algorithm"], opts.server[-8:],
                     opts.task, role.t.x.shape[0])
            reconnects = 0
            while True:
                ch = SplitChannel(stream, counter, ident.peer_id, side="client", max_frame=int(offer["max_frame"]),
                                  read_timeout=opts.read_timeout)
                try:
                    await role.session(ch, resume=reconnects > 0)
                    break
                except (TransportError, trio.TooSlowError) as e:
                    reconnects += 1
                    log.warning("split stream lost (%s); reconnecting", e)
                    await stream.reset()
                    stream = await link.open()
        except RemoteError as e:
            raise SplitJoinError(f"server {opts.server[-8:]} refused: {e}") from None
        except SplitError as e:
            await ch.send_error(str(e))
            raise SplitJoinError(f"split protocol error: {e}") from None
        finally:
            await stream.close()
        log.info("session done: rounds %s, metrics %s", role.out.rounds, role.out.metrics)
        if offer["algorithm"] == "msd":
            await trio.to_thread.run_sync(role.finetune)
        if opts.sync:
            await _sync(link, ledger)  # learn what the session produced (e.g. the weights entry)
        out = role.out
        rec = make_record(side="client", algorithm=offer["algorithm"], client=ident.peer_id, server=opts.server,
                          task=role.t.spec.to_dict(), params=out.params, counter=counter.to_dict(),
                          train_kinds=out.train_kinds, rounds=sorted(out.rounds), metrics=out.metrics,
                          losses={str(k): v for k, v in sorted(out.losses.items())}, data=opts.data,
                          reconnects=reconnects, service_entry=entry, started=started,
                          **({"variant": {"head": offer["head"], "pos_embed": offer["pos_embed"]}}
                             if offer["algorithm"] == "pfesta" else {}), **out.extra)
        path = await trio.to_thread.run_sync(lambda: write_record(home, rec))
        return JoinResult(record=rec, path=path)
    finally:
        await ledger.close()


async def _obtain_secret(ch: SplitChannel, link: _Link, ledger: LedgerAccess, ident: NodeIdentity,
                         service: str | None, offer: dict[str, Any], seed: int | None = None) -> tuple[str, dict]:
    """The campaign's embedder secret (p-FESTA / MSD), before joining (see `secret.py`):
    announce this node's X25519 key and sign its join of the campaign, ask the server which
    ``split_secret`` entry it adopted (asking makes the server accept this node, or refuse
    it, per its policy); if none and this node is the named maker (or the maker's secret did
    not come), make one (sealed to every client the server accepted), offer it. The adopted
    one must be what the server's signed adoption names here, and valid
    (`secret.check_adopted`); opened from the local ledger with this node's key;
    SplitSecretError if this node is not a recipient."""
    if service is None:
        raise SplitJoinError("the server named no signed service entry: cannot find the campaign's embedder secret")
    cfg = split_config(offer["body"])
    await ledger.run(lambda led: (ensure_hello(ident, led), ensure_joined(ident, led, service)))
    await ch.send("secret", None, {"entry": None})
    reply = (await ch.recv("secret_ok")).meta
    adopted = reply.get("entry")
    if adopted is None and reply.get("maker") not in (None, ident.peer_id):  # another client makes it
        await ch.send("secret", None, {"entry": None, "wait": True})
        adopted = (await ch.recv("secret_ok")).meta.get("entry")
    if adopted is None:
        await _sync(link, ledger)  # the other askers' hellos: the secret is sealed to them too
        mine = await ledger.run(lambda led: create_secret(ident, led, service, cfg, seed=seed))
        log.info("made the campaign's embedder secret %s", mine.id.hex()[:12])
        await ch.send("secret", None, {"entry": mine.id.hex()})
        adopted = (await ch.recv("secret_ok")).meta.get("entry")
    if not isinstance(adopted, str):
        raise SplitJoinError(f"the server adopted no usable embedder secret: {adopted!r:.80}")

    def has(led: Ledger) -> bool:  # the secret entry and the server's signed adoption of it
        try:
            here = led.get(adopted) is not None
        except ValueError:
            raise SplitJoinError(f"malformed embedder secret id {adopted!r:.80}") from None
        return here and acceptance(led, service_entry(led, service))[1] == adopted

    if not await ledger.run(has):
        await _sync(link, ledger)

    def check_and_open(led: Ledger) -> dict:
        check_adopted(led, adopted, service)  # what the server's signed adoption names, and valid
        return open_secret(ident, led, adopted, service, cfg)

    return adopted, await ledger.run(check_and_open)


def _make_role(home: NodeHome, cid: str, offer: dict[str, Any], opts: JoinOptions, embedder_state=None):
    """Load the data for the offered body and build the algorithm's client role."""
    specs = {t["name"]: TaskSpec.from_dict(t) for t in offer["tasks"]}
    if opts.task not in specs:
        raise SplitJoinError(f"task {opts.task!r} is not offered; the server offers {sorted(specs)}")
    spec = specs[opts.task]
    body = offer["body"]
    train = load_dataset(opts.data, body["img_size"], body["in_chans"], "train", seed=0)
    require_classes(train)
    x, y = prepare(train, spec, body["patch_size"])
    test = None
    if opts.evaluate:
        held = load_dataset(opts.test_data or opts.data, body["img_size"], body["in_chans"], "test", seed=0)
        test = prepare(held, spec, body["patch_size"])
    t = Task(client=cid, offer=offer, spec=spec, x=x, y=y, test=test, rounds=opts.rounds, seed=opts.seed,
             lr=opts.lr, permute=opts.permute, store=BlobStore(home.blobs_dir), finetune_steps=opts.finetune_steps,
             finetune_lr=opts.finetune_lr, compare_scratch=opts.compare_scratch, embedder_state=embedder_state,
             device=resolve_device(None, home=home))
    return ROLES[offer["algorithm"]](t)


def join(home: NodeHome, opts: JoinOptions, *, listen: str = "/ip4/127.0.0.1/tcp/0") -> JoinResult:
    """`atd split join`: run a session over a transient libp2p transport (blocking)."""
    from atdnode.transport import Libp2pTransport

    ident = NodeIdentity.load(home)

    async def main() -> JoinResult:
        transport = Libp2pTransport(ident.libp2p_keypair())
        async with transport.run([listen]):
            return await run_join(home, transport, opts)

    try:
        return trio.run(main)
    except BaseExceptionGroup as eg:  # the transport's nursery wraps what went wrong inside it
        leaf = single_error(eg)
        if isinstance(leaf, AtdError):
            raise leaf from None
        if isinstance(leaf, SplitError):
            raise SplitJoinError(str(leaf)) from None
        raise
    except SplitError as e:
        raise SplitJoinError(str(e)) from None


def single_error(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one member, else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
