"""Ledger benchmark: append+sign and verify throughput against bare Ed25519 loops (same run).

    python bench/ledger_bench.py [--quick] [--n 10000] [--big 100000]

Prints one JSON object:
  append_sign: Ledger.append of n entries (one durable SQLite transaction each: the WAL is
               fsynced before append returns) vs a bare Ed25519 sign loop over the
               same signed bytes -> ratio. Also the same
               run's bare write+fsync rate in the same directory (`fsync_per_s`): a durable
               append cannot beat one fsync, so `ratio_to_fsync` shows what is left to gain.
  append_sign_grouped: the daemon's path (`LedgerAccess.append`, group commit):
               n entries appended by `--appenders` concurrent trio tasks (default 32), each
               entry durable (its group's transaction fsynced, synchronous=FULL) before its
               append returns, vs a bare sign loop over n messages timed half right before
               and half right after (so both see the same machine load) -> ratio (target
               >= 0.3); `fsyncs` = group commits, `entries_per_fsync` their mean size.
               A closed loop of k appenders cannot form groups larger than k, and every
               group waits one fsync, so `fsync_ceiling` = what the ratio would be if a group
               cost nothing but its signatures and one bare write+fsync in the same directory
               (fdatasync rate measured in the same run); `group_ms`: a group's mean time in the
               ledger thread (signing, inserting, COMMIT: WAL writes of ~2.6 pages an entry,
               the fdatasync, WAL checkpoints), `in_ledger_thread` the share
               of the run spent there (the rest: trio scheduling, thread hops, waiting for a CPU). `by_appenders` repeats the run with the `--sweep` appender counts
               (default 8 and 128) to show the scaling.
  verify:      Ledger.verify() of those n entries (read back from SQLite) vs a bare
               Ed25519 verify loop over the same (bytes, sig) pairs -> ratio (target >= 0.5)
  verify_big:  Ledger.verify() of a `big`-entry, 8-author ledger read from SQLite, entries/s
               (and its ratio to a bare verify loop over a sample of the same entries)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger import Entry, Ledger, Signer, ZERO_HASH


def body(i: int) -> dict:
    return {"blob": os.urandom(32).hex(), "size": 1000 + i, "part": "extractor", "samples": i, "metrics": {"acc": 0.5}}


def bench_append_verify(path: str, n: int) -> dict:
    seed = os.urandom(32)
    signer = Signer.from_seed(seed)
    led = Ledger.open(path)
    led.create_genesis(signer, "bench")
    bodies = [body(i) for i in range(n)]
    t0 = time.perf_counter()
    entries = [led.append(signer, "weights", b) for b in bodies]
    t_append = time.perf_counter() - t0

    raw_key = Ed25519PrivateKey.from_private_bytes(seed)
    msgs = [e.signed_bytes() for e in entries]
    t0 = time.perf_counter()
    sigs = [raw_key.sign(m) for m in msgs]
    t_sign = time.perf_counter() - t0

    t0 = time.perf_counter()
    led.verify()
    t_verify = time.perf_counter() - t0
    pk = Ed25519PublicKey.from_public_bytes(signer.public_key)
    t0 = time.perf_counter()
    for m, s in zip(msgs, sigs):
        pk.verify(s, m)
    t_bare_verify = time.perf_counter() - t0
    led.close()
    fsync_per_s = _fsync_rate(os.path.dirname(path), min(n, 500))
    total = n + 1  # verify also covers the genesis entry
    return {
        "append_sign": {"n": n, "durable": True, "entries_per_s": round(n / t_append),
                        "bare_sign_per_s": round(n / t_sign), "ratio": round(t_sign / t_append, 3),
                        "fsync_per_s": round(fsync_per_s), "ratio_to_fsync": round((n / t_append) / fsync_per_s, 3)},
        "verify": {"n": total, "entries_per_s": round(total / t_verify), "bare_verify_per_s": round(n / t_bare_verify),
                   "ratio": round((total / t_verify) / (n / t_bare_verify), 3), "target": 0.5},
    }


def bench_grouped(path: str, n: int, appenders: int) -> dict:
    """n own appends through LedgerAccess (group commit) from `appenders` concurrent tasks."""
    import trio

    from atdnode.replication import LedgerAccess

    seed = os.urandom(32)
    signer = Signer.from_seed(seed)
    led = Ledger.open(path)
    led.create_genesis(signer, "bench")
    access = LedgerAccess(led, own=signer.public_key)
    bodies = [body(i) for i in range(n)]
    raw_key = Ed25519PrivateKey.from_private_bytes(seed)
    msgs = [os.urandom(200) for _ in range(n)]

    def bare_sign(part: list[bytes]) -> float:
        t0 = time.perf_counter()
        for m in part:
            raw_key.sign(m)
        return time.perf_counter() - t0

    async def run() -> float:
        it = iter(bodies)

        async def appender() -> None:
            for b in it:
                await access.append(signer, "weights", b)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(appenders):
                nursery.start_soon(appender)
        return time.perf_counter() - t0

    t_sign = bare_sign(msgs[: n // 2])  # the baseline brackets the run: half before ...
    t_append = trio.run(run)
    t_sign += bare_sign(msgs[n // 2:])  # ... half after
    assert led.heads()[signer.public_key] == n + 1
    led.verify()
    led.close()
    fsync_s = 1 / _fsync_rate(os.path.dirname(path), 200)
    per_fsync = n / max(1, access.commits)
    sign_s = t_sign / n
    commit_s = access.commit_s / max(1, access.commits)
    return {"n": n, "appenders": appenders, "durable": True, "entries_per_s": round(n / t_append),
            "bare_sign_per_s": round(n / t_sign), "ratio": round(t_sign / t_append, 3), "target": 0.3,
            "fsyncs": access.commits, "entries_per_fsync": round(per_fsync, 1),
            "fsync_ms": round(fsync_s * 1e3, 2), "fsync_ceiling": round(sign_s / (sign_s + fsync_s / per_fsync), 3),
            "group_ms": round(commit_s * 1e3, 2), "in_ledger_thread": round(access.commit_s / t_append, 3),
            "load": [round(x, 1) for x in os.getloadavg()]}


def _fsync_rate(directory: str, n: int) -> float:
    """Bare 4 KiB overwrite + fdatasync loop on one file in `directory`: what SQLite's WAL
    commit does (it fdatasyncs a WAL that, once it reached its size, is overwritten in
    place). The file is written and synced once first: fsyncs that allocate blocks cost
    several times more on ext4 and made this 3-4 ms instead of ~0.05-1 ms."""
    fd = os.open(os.path.join(directory, "fsync.bin"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * 4096 * 64, 0)
        os.fsync(fd)
        t0 = time.perf_counter()
        for i in range(n):
            os.pwrite(fd, b"x" * 4096, (i % 64) * 4096)
            os.fdatasync(fd)
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def bench_big(path: str, n: int, authors: int = 8) -> dict:
    signers = [Signer.generate() for _ in range(authors)]
    led = Ledger.open(path)
    g = led.create_genesis(signers[0], "bench", members=[(s.public_key, False) for s in signers[1:]])
    heads = {s.public_key: (1, g.id) if s is signers[0] else (0, ZERO_HASH) for s in signers}
    t0 = time.perf_counter()
    batch: list[Entry] = []
    sample: list[tuple[bytes, bytes, bytes]] = []
    for i in range(n - 1):
        s = signers[i % authors]
        seq, prev = heads[s.public_key]
        e = Entry.create(s, seq=seq + 1, prev=prev, lamport=i + 2, kind="metrics", body={"i": i, "acc": 0.5})
        heads[s.public_key] = (seq + 1, e.id)
        batch.append(e)
        if len(sample) < 10_000:
            sample.append((e.signed_bytes(), e.sig, e.author))
        if len(batch) == 10_000:
            led.merge(batch)
            batch = []
    led.merge(batch)
    t_build = time.perf_counter() - t0
    led.close()
    keys = {s.public_key: Ed25519PublicKey.from_public_bytes(s.public_key) for s in signers}
    t0 = time.perf_counter()
    for m, sig, author in sample:
        keys[author].verify(sig, m)
    bare = len(sample) / (time.perf_counter() - t0)
    led = Ledger.open(path)  # verification reads everything back from SQLite
    t0 = time.perf_counter()
    report = led.verify()
    t_verify = time.perf_counter() - t0
    led.close()
    assert report.log == n, report
    return {"n": n, "authors": authors, "entries_per_s": round(n / t_verify), "seconds": round(t_verify, 2),
            "bare_verify_per_s": round(bare), "ratio": round(n / t_verify / bare, 3),
            "build_entries_per_s": round((n - 1) / t_build), "db_mb": round(os.path.getsize(path) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts (1,000 / 10,000) for a smoke run")
    ap.add_argument("--n", type=int, default=None, help="entries for append / verify (default 10,000)")
    ap.add_argument("--appenders", type=int, default=32, help="concurrent appenders for append_sign_grouped")
    ap.add_argument("--sweep", default="8,128", help="further appender counts for append_sign_grouped.by_appenders "
                    "(comma-separated; empty: none)")
    ap.add_argument("--big", type=int, default=None, help="entries for the big verification (default 100,000)")
    args = ap.parse_args()
    n = args.n or (1_000 if args.quick else 10_000)
    big = args.big or (10_000 if args.quick else 100_000)
    with tempfile.TemporaryDirectory() as d:
        out = bench_append_verify(os.path.join(d, "small.db"), n)
        out["append_sign_grouped"] = grouped = bench_grouped(os.path.join(d, "grouped.db"), n, args.appenders)
        grouped["by_appenders"] = {}
        for k in [int(x) for x in args.sweep.split(",") if x.strip()]:
            r = bench_grouped(os.path.join(d, f"grouped{k}.db"), n, k)
            grouped["by_appenders"][k] = {x: r[x] for x in ("ratio", "entries_per_fsync", "group_ms", "in_ledger_thread",
                                                            "load")}
        out["verify_big"] = bench_big(os.path.join(d, "big.db"), big)
    out["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
