"""Where each millisecond of a real bulk fetch goes, per 4 MiB of blob, sender and receiver.

    python bench/transfer_timeline.py [--size-mb 350] [--modes bulk,bulk_parallel] [--reps 2]

transfer_profile.py times each stage of the bulk path alone; this runs transfer_bench.py's
two node processes with the stages of the library's own calls wrapped in timers
(`install`, activated in each node by ATD_XFER_TIMELINE=1), so the numbers are those of a
real fetch: each stage's wall time and its thread's CPU time (wall minus CPU is waiting:
for the peer, the disk or the GIL), per 4 MiB, summed over every thread of that side.

Receiver (client): `recv` (SealedSocket.read_raw: socket -> preallocated buffer),
`decrypt` (read_frame less read_raw: AES-GCM decrypt_into + header unpack), `pwrite`
(the chunk into the preallocated partial file), `sha256` (the whole-blob hash over the
written prefix, inline in a writer: PartialBlob._advance_hash -- now only what is left when
complete() stops the hasher), `hasher_thread` (PartialBlob.start_hasher's thread: its CPU
is the whole-blob SHA-256 from the page cache; its wall includes waiting for chunks), the
first chunk per connection also gets its own hash (`check_chunk`), `flush` (fdatasync +
record, in the flusher thread beside the workers), `complete` (final fsync, rename). Sender (server): `send` (sendall of the
sealed frames), `encrypt` (write_frames less send), `read_file` (_send_ranges less both).
`setup_ms`: fetch start to the first chunk written (manifest, key exchange, connects);
`wall_ms_per_4mib`: the whole fetch. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from functools import wraps
from pathlib import Path

FRAME = 4 << 20
_LOCK = threading.Lock()
_ACC: dict[str, list[float]] = {}  # stage -> [wall s, thread CPU s, calls]
_MARK: dict[str, float] = {}


def _timed_async(owner: object, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    @wraps(fn)
    async def wrapper(*a, **kw):
        w0 = time.perf_counter()
        try:
            return await fn(*a, **kw)
        finally:
            with _LOCK:
                _MARK.setdefault(f"{name}_first", w0 - _MARK.get("start", w0))
                _MARK[f"{name}_last"] = time.perf_counter() - _MARK.get("start", w0)

    setattr(owner, attr, wrapper)


def _timed(owner: object, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    @wraps(fn)
    def wrapper(*a, **kw):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            w, c = time.perf_counter() - w0, time.thread_time() - c0
            with _LOCK:
                _MARK.setdefault(f"{name}_first", w0 - _MARK.get("start", w0))
                _MARK[f"{name}_last"] = w0 + w - _MARK.get("start", w0)
                row = _ACC.setdefault(name, [0.0, 0.0, 0])
                row[0] += w
                row[1] += c
                row[2] += 1

    setattr(owner, attr, wrapper)


def install() -> None:
    """Wrap the bulk path's stages in timers (this process only)."""
    import atdnode.blobs.partial as bp
    import atdnode.blobs.bulk_server as bs
    from atdnode.blobs.bulk import SealedSocket

    for owner, attr, name in ((SealedSocket, "read_raw", "recv"), (SealedSocket, "read_frame", "read_frame"),
                              (SealedSocket, "_send", "send"), (SealedSocket, "write_frames", "write_frames"),
                              (bs, "_send_ranges", "send_ranges"), (bp, "write_all", "pwrite"),
                              (bp.PartialBlob, "_advance_hash", "sha256"), (bp.PartialBlob, "check_chunk", "check_chunk"),
                              (bp.PartialBlob, "flush", "flush"), (bp.PartialBlob, "complete", "complete"),
                              (bp.PartialBlob, "write_chunk", "write_chunk"),
                              (bp.PartialBlob, "_hash_loop", "hasher_thread")):
        _timed(owner, attr, name)
    from atdnode.blobs import BlobStore
    from atdnode.blobs.fetch import BlobFetcher
    from atdnode.blobs.bulk import BulkConn
    from atdnode.transport import Libp2pTransport

    for owner, attr, name in ((Libp2pTransport, "open_stream", "open_stream"), (BlobFetcher, "_probe", "probe"),
                              (BlobFetcher, "_bulk", "bulk_channel"), (BulkConn, "open", "bulk_connect")):
        _timed_async(owner, attr, name)
    _timed(BlobStore, "partial", "store_partial")
    first = bp.PartialBlob.write_chunk

    def mark_first(self, *a, **kw):
        _MARK.setdefault("first_chunk", time.perf_counter())
        return first(self, *a, **kw)

    bp.PartialBlob.write_chunk = mark_first


def reset() -> None:
    with _LOCK:
        _ACC.clear()
        _MARK.clear()
        _MARK["start"] = time.perf_counter()


def take(nbytes: int) -> dict:
    """Per-4-MiB wall / CPU milliseconds of each stage since `reset`, derived stages split out."""
    with _LOCK:
        acc = {k: list(v) for k, v in _ACC.items()}
    frames = nbytes / FRAME

    def less(a: str, *parts: str) -> list[float] | None:
        if a not in acc:
            return None
        return [acc[a][j] - sum(acc[p][j] for p in parts if p in acc) for j in (0, 1)] + [acc[a][2]]

    derived = {"decrypt": less("read_frame", "recv"), "encrypt": less("write_frames", "send"),
               "read_file": less("send_ranges", "write_frames"),
               "write_chunk_other": less("write_chunk", "pwrite", "sha256", "check_chunk")}
    acc.update({k: v for k, v in derived.items() if v is not None})
    for k in ("read_frame", "write_frames", "send_ranges", "write_chunk"):
        acc.pop(k, None)
    out = {k: {"wall_ms": round(v[0] * 1e3 / frames, 3), "cpu_ms": round(v[1] * 1e3 / frames, 3)}
           for k, v in sorted(acc.items())}
    if "first_chunk" in _MARK:
        out["setup_ms"] = round((_MARK["first_chunk"] - _MARK["start"]) * 1e3, 1)
    out["marks_ms"] = {k: round(v * 1e3, 1) for k, v in sorted(_MARK.items(), key=lambda kv: kv[1]) if k.endswith(("_first", "_last"))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=350)
    ap.add_argument("--modes", default="bulk,bulk_parallel")
    ap.add_argument("--reps", type=int, default=1)
    a = ap.parse_args()
    bench = Path(__file__).with_name("transfer_bench.py")
    env = {**os.environ, "ATD_XFER_TIMELINE": "1"}
    runs = []
    for _ in range(a.reps):
        out = subprocess.run([sys.executable, str(bench), "--size-mb", str(a.size_mb), "--modes", a.modes],
                             env=env, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out))
    res: dict = {"size_mb": a.size_mb, "frame_mb": FRAME / 2**20, "runs": []}
    for r in runs:
        row = {"loadavg_1m": r["loadavg_1m"], "baseline_MBps": r["baseline_tcp_sha256"]["MBps"]}
        for m in a.modes.split(","):
            if m in r:
                x = r[m]
                row[m] = {"ratio": x["ratio"], "MBps": x["MBps"],
                          "wall_ms_per_4mib": round(x["seconds"] * 1e3 / (x["bytes"] / FRAME), 3),
                          "receiver": x.get("timeline_client"), "sender": x.get("timeline_server")}
        res["runs"].append(row)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
