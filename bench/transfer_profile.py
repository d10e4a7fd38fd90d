"""Where the time of one bulk frame goes: each stage of the encrypted bulk path, timed alone.

    python bench/transfer_profile.py [--frame-mb 4] [--reps 20]

Prints one JSON object: milliseconds per frame (median of --reps, and min) for each stage the
bulk channel (`atdnode/blobs/bulk.py`) and the fetcher (`blobfetch.py`, `blobpartial.py`)
run on one frame, using the same library calls:

  sender:   file_readinto (page cache) -> aes_gcm_encrypt_into -> socket (sealed frame)
  receiver: socket -> aes_gcm_decrypt_into -> pwrite into a fresh preallocated file
            (`pwrite_fresh`: what a download does; `pwrite` rewrites cached pages) -> sha256
            (the whole-blob hash, once); the periodic fdatasync (`fdatasync_share`: this
            frame's share, mostly I/O wait) now runs in a flusher thread beside the workers
  glue:     thread_hop (`trio.to_thread.run_sync` of a no-op; now paid once per 16 MiB batch,
            not per frame), memcpy (one copy of the frame, what a `bytes(...)` costs)

`socket_sealed` is one SealedSocket.write_frame -> read_frame round of a frame between two
threads over loopback TCP (encrypt + send + receive + decrypt); `socket_raw` the same bytes with
sendall / recv_into only. `baseline_tcp_sha256` = socket_raw + one SHA-256, what
transfer_bench's baseline does per frame. `receiver_path_ms` is the receiver's serial path now: the
slower of its receiving thread (socket + AES-GCM + pwrite + a share of the batch's thread hop)
and its hasher thread (SHA-256 from the page cache), which run on two cores at once (the
sender's stages run in the other process); `receiver_one_thread_ms` both in one thread (before
the hasher thread); `receiver_path_before_ms` the unoptimised path, as a baseline (two SHA-256 per byte,
pwrite and two thread hops per frame, fsync inline).
`ratio_if_serial` = baseline / receiver path: what a fetch would reach if the receiver's path alone
limited it (the sender has a core of its own; on 2 cores it does not).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import tempfile
import threading
import time

import trio
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from atdnode.blobs.bulk import TAG, SealedSocket


def timed(fn, reps: int) -> dict:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(out), 3), "min_ms": round(min(out), 3)}


def socket_rounds(n: int, reps: int, sealed: bool) -> dict:
    """reps frames of n bytes over loopback TCP between two threads; ms per frame."""
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    key_ab, key_ba = os.urandom(32), os.urandom(32)
    tx, rx = SealedSocket(a, "rx", 30), SealedSocket(b, "tx", 30)
    tx.set_keys(key_ab, key_ba)
    rx.set_keys(key_ba, key_ab)
    payload, into = bytearray(os.urandom(n)), bytearray(n + TAG)
    times: list[float] = []

    def send() -> None:
        for _ in range(reps):
            if sealed:
                tx.write_frame(payload)
            else:
                a.sendall(payload)

    t = threading.Thread(target=send)
    t.start()
    view = memoryview(into)[:n]
    for _ in range(reps):
        t0 = time.perf_counter()
        if sealed:
            rx.read_frame(n, into)
        else:
            got = 0
            while got < n:
                got += b.recv_into(view[got:])
        times.append((time.perf_counter() - t0) * 1e3)
    t.join()
    tx.close()
    rx.close()
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3)}


def thread_hop(reps: int) -> dict:
    async def main() -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await trio.to_thread.run_sync(lambda: None)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    out = trio.run(main)
    return {"median_ms": round(statistics.median(out), 3), "min_ms": round(min(out), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frame-mb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    n, reps = int(a.frame_mb * 2**20), a.reps
    data = bytearray(os.urandom(n))
    out_buf, plain = bytearray(n + TAG), bytearray(n)
    aes = AESGCM(os.urandom(32))
    nonce = [0]

    def enc() -> None:
        nonce[0] += 1
        aes.encrypt_into(nonce[0].to_bytes(12, "big"), data, None, out_buf)

    aes.encrypt_into(b"\0" * 12, data, None, out_buf)
    ct = bytes(out_buf)
    stages: dict = {"frame_mb": a.frame_mb, "reps": reps, "loadavg_1m": os.getloadavg()[0]}
    stages["aes_gcm_encrypt_into"] = timed(enc, reps)
    stages["aes_gcm_decrypt_into"] = timed(lambda: aes.decrypt_into(b"\0" * 12, ct, None, plain), reps)
    stages["sha256"] = timed(lambda: hashlib.sha256(data).digest(), reps)
    stages["memcpy"] = timed(lambda: bytes(data), reps)
    with tempfile.TemporaryDirectory() as d:
        fd = os.open(os.path.join(d, "f"), os.O_RDWR | os.O_CREAT)
        os.pwrite(fd, data, 0)
        stages["pwrite"] = timed(lambda: os.pwrite(fd, data, 0), reps)
        with open(os.path.join(d, "f"), "rb", buffering=0) as f:
            stages["file_readinto"] = timed(lambda: (f.seek(0), f.readinto(plain)), reps)
        os.close(fd)
        fresh = os.open(os.path.join(d, "g"), os.O_RDWR | os.O_CREAT)
        os.posix_fallocate(fresh, 0, n * reps)  # as PartialBlob does
        at = [0]

        def pwrite_fresh() -> None:
            os.pwrite(fresh, data, at[0])
            at[0] += n

        stages["pwrite_fresh"] = timed(pwrite_fresh, reps)
        t0 = time.perf_counter()
        os.fdatasync(fresh)  # the reps frames written above: each frame's share of the sync
        stages["fdatasync_share"] = {"median_ms": round((time.perf_counter() - t0) * 1e3 / reps, 3)}
        os.close(fresh)
    stages["thread_hop"] = thread_hop(reps * 10)
    stages["socket_raw"] = socket_rounds(n, reps, sealed=False)
    stages["socket_sealed"] = socket_rounds(n, reps, sealed=True)
    m = {k: v["median_ms"] for k, v in stages.items() if isinstance(v, dict)}
    frames_per_batch = max(1, (16 << 20) // n)  # FetchConfig.batch_bytes
    base = m["socket_raw"] + m["sha256"]
    now = {"socket+aes": m["socket_sealed"], "pwrite_fresh": m["pwrite_fresh"],
           "thread_hop": m["thread_hop"] / frames_per_batch}  # fdatasync: in the flusher, beside
    # the whole-blob SHA-256 runs in the hasher thread (PartialBlob.start_hasher), beside the
    # receiving thread: the serial path is the slower of the two
    receiving = sum(now.values())
    now["sha256 (hasher thread)"] = m["sha256"]
    before = m["socket_sealed"] + 2 * m["sha256"] + m["pwrite_fresh"] + m["fdatasync_share"] + 2 * m["thread_hop"]
    path = max(receiving, m["sha256"])
    stages["receiver_thread_ms"] = round(receiving, 3)
    stages["hasher_thread_ms"] = m["sha256"]
    stages["receiver_one_thread_ms"] = round(receiving + m["sha256"], 3)  # before the hasher thread
    stages["baseline_tcp_sha256_ms"] = round(base, 3)
    stages["receiver_path_ms"] = round(path, 3)
    stages["receiver_path_before_ms"] = round(before, 3)
    stages["ratio_if_serial"] = round(base / path, 3)
    stages["ratio_if_serial_before"] = round(base / before, 3)
    stages["receiver_split_ms"] = {k: round(v, 3) for k, v in now.items()}
    stages["receiver_split_pct"] = {k: round(100 * v / (receiving + m["sha256"]), 1) for k, v in now.items()}
    stages["sender_path_ms"] = round(m["file_readinto"] + m["aes_gcm_encrypt_into"], 3)
    print(json.dumps(stages, indent=1))


if __name__ == "__main__":
    main()
