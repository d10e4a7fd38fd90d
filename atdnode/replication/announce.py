"""Gossip out: a daemon's own entries, its `hello`, and the seq announced so far.

`Announcer` gossips every entry this node authors, whether the daemon appended it
(`append`, at once) or a CLI command in another process did (`announce_loop` watches the
ledger files' stamp, `ledger_stamp`). Nothing is signed or gossiped before the replicator's
`head_confirmed` is set (safe restart). The home's `announced` file keeps the seq
gossiped so far (`read_announced` / `write_announced`): a restart does not re-gossip older
entries. `maybe_say_hello()` appends a signed `hello` (addresses, X25519 key, role, name)
once we are a member and our addresses or role changed. Reader lists of blob entries are
refreshed before such an entry is gossiped (nobody hears of a blob before its readers hold).
"""
from __future__ import annotations

import logging
import os
import sqlite3
from typing import Callable

import trio

from atdnode import bodies
from atdnode.blobs import BlobReaders
from atdnode.node import NodeConfig, NodeHome, NodeIdentity
from atdnode.replication.ledger_access import LedgerAccess
from atdnode.replication.replicator import BLOB_KINDS_SET, Replicator
from atdnode.transport import Transport, TransportError
from ledger import Entry, Ledger

log = logging.getLogger("atd.daemon")

LEDGER_RECHECK_S = 30.0  # the announce loop reads the ledger at least this often, changed or not
QUIET_TICKS = 8  # poll ticks without a ledger change before the announce loop polls slower ...
IDLE_POLL_S = 1.0  # ... at most this often (4 wakeups a second of 100 idle daemons add up)


class Announcer:
    """The gossip-out side of one `NodeDaemon` (module doc)."""

    def __init__(self, *, home: NodeHome, identity: NodeIdentity, config: NodeConfig, ledger: LedgerAccess,
                 transport: Transport, topic: str, readers: BlobReaders, replica: Replicator,
                 poll_interval: float, addrs: Callable[[], list[str]] | None = None) -> None:
        self.home, self.identity, self.config, self.ledger = home, identity, config, ledger
        self.transport, self.topic, self.readers, self.replica = transport, topic, readers, replica
        self.poll_interval = poll_interval
        self.addrs = addrs or transport.addrs  # what the hello says others dial (NodeDaemon.addrs)
        self.announced_seq = 0
        self._hello_said: tuple | None = None  # (addrs, role) of our last signed hello

    async def load(self) -> None:
        """Read the seq gossiped before the last stop (start-up)."""
        self.announced_seq = await trio.to_thread.run_sync(read_announced, self.home)

    async def save(self) -> None:
        """Record the seq gossiped so far (clean stop)."""
        if self.announced_seq:
            await trio.to_thread.run_sync(write_announced, self.home, self.announced_seq)

    async def announce_loop(self) -> None:
        """Gossip entries this node authored (by the daemon or by CLI commands) since last time."""
        me = self.identity.public_key
        confirmed = self.replica.head_confirmed
        with trio.move_on_after(30):
            await confirmed.wait()  # never gossip own entries a member may contradict
        if not confirmed.is_set():
            log.warning("no member reachable yet to confirm this node's own chain head: signing nothing until one is "
                        "(restart with --bootstrap <member address>)")
            await confirmed.wait()
        head = await self.ledger.run(lambda led: led.head_of(me))
        saved = self.announced_seq = min(self.announced_seq, head)  # a restored home may hold fewer
        stamp, recheck_at, quiet = None, 0.0, 0
        db = os.fspath(self.home.ledger_db)
        while True:
            # Idle cost: the ledger is read only when its files changed (a CLI
            # command appended, or a merge), when no hello went out yet, and every
            # LEDGER_RECHECK_S; otherwise a poll tick is two stat calls, no thread hop. After
            # QUIET_TICKS unchanged ticks the loop polls every IDLE_POLL_S instead of every
            # poll_interval: an entry a CLI command appends to an idle node goes out within
            # IDLE_POLL_S (own appends through the daemon are gossiped at once, `append`).
            now = trio.current_time()
            new_stamp = ledger_stamp(db)
            if new_stamp == stamp and now < recheck_at and self._hello_said is not None:
                quiet += 1
                await trio.sleep(idle_poll(self.poll_interval, quiet))
                continue
            stamp, recheck_at, quiet = new_stamp, now + LEDGER_RECHECK_S, 0
            try:
                await self.maybe_say_hello()
            except (sqlite3.OperationalError, OSError) as exc:
                await self.replica.disk_trouble("appending hello", exc)
            head = await self.ledger.run(lambda led: led.head_of(me))
            if self.announced_seq != saved:  # a restart re-gossips only what was never announced
                saved = self.announced_seq
                await trio.to_thread.run_sync(write_announced, self.home, saved)
            if head > self.announced_seq:
                seq = self.announced_seq
                entries = await self.ledger.run(lambda led: led.entries_after(me, seq))
                if {e.kind for e in entries} & BLOB_KINDS_SET:  # reader lists before anyone hears of a blob
                    await self.ledger.run(self.readers.refresh)
                for e in entries:
                    try:
                        await self.transport.publish(self.topic, e.to_bytes())
                    except TransportError as exc:  # no peers yet: sync will carry it
                        log.debug("publish of %s deferred: %s", e.id.hex()[:12], exc)
                    self.announced_seq = e.seq
                await self.replica.after_merge({e.kind for e in entries})
            await trio.sleep(self.poll_interval)

    async def append(self, kind: str, body: dict) -> Entry:
        """Sign and store an entry, and gossip it at once (no wait for the announce loop).

        Waits until the own chain head was confirmed with a member (module doc)."""
        await self.replica.head_confirmed.wait()
        entry = await self.ledger.append(self.identity.signer, kind, bodies.check_body(kind, body))  # group commit
        if kind in BLOB_KINDS_SET:  # its reader list holds before the entry is gossiped
            await self.ledger.run(self.readers.refresh)
        if entry.seq == self.announced_seq + 1:
            try:
                await self.transport.publish(self.topic, entry.to_bytes())
                self.announced_seq = entry.seq
            except TransportError as exc:
                log.debug("publish deferred: %s", exc)
        return entry

    async def maybe_say_hello(self) -> None:
        """Append a signed `hello` (addresses, X25519 key, role) once we are a member and addrs changed."""
        me = self.identity.public_key
        if me not in self.replica.members or not self.replica.head_confirmed.is_set():
            return
        addrs = self.addrs()
        said = (tuple(addrs), self.config.role)
        if self._hello_said == said:  # checked on every poll tick: no query each time
            return

        def current(led: Ledger):
            hellos = led.query(kind="hello", author=me)
            return hellos[-1].body if hellos else None

        last = await self.ledger.run(current)
        body = {
            "addrs": addrs,
            "x25519": self.identity.x25519_public,
            "role": self.config.role,
            "name": self.config.name,
        }
        if last is not None and last.get("addrs") == addrs and last.get("role") == body["role"]:
            self._hello_said = said
            return
        await self.ledger.append(self.identity.signer, "hello", bodies.check_body("hello", body))
        self._hello_said = said


def idle_poll(poll_interval: float, quiet_ticks: int) -> float:
    """Seconds to the next announce tick after `quiet_ticks` ticks without a ledger change:
    `poll_interval` at first, IDLE_POLL_S (or `poll_interval`, if longer) once quiet."""
    return poll_interval if quiet_ticks < QUIET_TICKS else max(poll_interval, IDLE_POLL_S)


def ledger_stamp(db: "os.PathLike[str] | str") -> tuple:
    """A cheap change signal for a SQLite ledger file: (size, mtime, inode) of the database
    and of its WAL. Any commit, from this process or another one (a CLI command), changes
    it. Two stat calls of a local file cost microseconds, so they run on the event loop;
    the ledger itself is read in a worker thread only when the stamp moved."""
    out = []
    db = os.fspath(db)
    for path in (db, db + "-wal"):
        try:
            st = os.stat(path)
            out.append((st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def read_announced(home: NodeHome) -> int:
    """The seq up to which this node's own entries were gossiped (0: none, or unknown)."""
    try:
        return max(0, int(home.announced_file.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0


def write_announced(home: NodeHome, seq: int) -> None:
    """Remember (atomically) that own entries up to `seq` were gossiped; best effort."""
    tmp = home.announced_file.with_suffix(".tmp")
    try:
        tmp.write_text(str(seq))
        tmp.replace(home.announced_file)
    except OSError as exc:  # a full disk costs only duplicate gossip after a restart
        log.debug("could not record the announced seq: %s", exc)
