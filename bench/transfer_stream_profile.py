"""Where the time of one chunk goes on the libp2p-stream fallback, stage by stage, before
and after yamux_tuning.

    python bench/transfer_stream_profile.py [--size-mb 64]

Runs transfer_bench.py's `stock` (py-libp2p's own yamux) and `single` (TunedYamux) modes
with both node processes under cProfile, then sorts each process's event-loop thread time
(cProfile's own time per function, so each millisecond is counted once) into stages and
prints one JSON object: milliseconds per 1 MiB chunk, per stage, per side (`server`
sends, `client` receives, verifies and writes), profiled during the fetch only.
cProfile slows Python code (not C code such as ChaCha20 or syscalls) by a roughly
constant factor, so compare stages and before/after, not absolute totals, with the
benchmark's own numbers.

Stages: `noise_crypto` (ChaCha20-Poly1305 seal/open), `socket` (send/recv syscalls),
`noise_framing` (py-libp2p's Noise message, SecureSession and raw-connection reads and
writes in Python), `yamux` (frame headers, window accounting, locks, handle_incoming,
read_stream; yamux_tuning counted here), `copies` (bytes joins/extends in C), `trio`
(the scheduler and its locks, events, cancel scopes), `thread_hops` (to_thread: the pread,
the write + SHA-256 thread, their handover), `epoll_wait` (waiting for I/O: idle, not CPU),
`atd` (framing.py and the blob protocol), `other`.
"""
from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).with_name("transfer_bench.py")


def stage(filename: str, name: str) -> str:
    """The stage of one profiled function (module doc)."""
    if filename == "~":
        if "ChaCha20Poly1305" in name or "AESGCM" in name:
            return "noise_crypto"
        if any(k in name for k in ("'send'", "'recv'", "'recv_into'", "'sendall'")):
            return "socket"
        if "'poll' of 'select.epoll'" in name:
            return "epoll_wait"
        if "_thread" in name or "lock" in name:
            return "thread_hops"
        if any(k in name for k in ("'join' of 'bytes'", "'extend' of 'bytearray'", "builtins.bytes")):
            return "copies"
        return "other"
    if "yamux" in filename:
        return "yamux"
    if "/noise/" in filename or "/libp2p/security/" in filename or "/libp2p/io/" in filename \
            or "raw_connection" in filename or "libp2p_pubsub" in filename:
        return "noise_framing"
    if "/trio/_threads" in filename or "_thread_cache" in filename or "threading" in filename:
        return "thread_hops"
    if "/trio/" in filename or "/outcome/" in filename or "contextlib" in filename:
        return "trio"
    if "atdnode" in filename:
        return "atd"
    return "other"


def split(path: Path, chunks: float) -> dict:
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        k = stage(filename, name)
        out[k] = out.get(k, 0.0) + tottime
    ms = {k: round(v * 1e3 / chunks, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}
    ms["total_cpu_like"] = round(sum(v for k, v in ms.items() if k != "epoll_wait"), 3)
    return ms


def run(mode: str, size_mb: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="atd-xprof-") as d:
        env = {**os.environ, "ATD_XFER_PROFILE": d}
        res = subprocess.run([sys.executable, str(BENCH), "--size-mb", str(size_mb), "--modes", mode],
                             env=env, capture_output=True, text=True, check=True)
        bench = json.loads(res.stdout)[mode]
        chunks = size_mb * 1e6 / 2**20
        return {"fetch_ms_per_chunk": round(bench["seconds"] * 1e3 / chunks, 3),
                "cpu_server_s": bench["cpu_server_s"], "cpu_client_s": bench["cpu_client_s"],
                # CPU of the event-loop thread vs the worker threads (pread; write + SHA-256), per chunk
                "threads_ms_per_chunk": {side: {k: round(v * 1e3 / chunks, 3)
                                                for k, v in bench[f"threads_{side}"].items()}
                                         for side in ("server", "client")},
                "server": split(Path(d) / f"{mode}-server.pstats", chunks),
                "client": split(Path(d) / f"{mode}-client.pstats", chunks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=64)
    a = ap.parse_args()
    out = {"size_mb": a.size_mb, "chunk_mib": 1, "loadavg_1m": os.getloadavg()[0]}
    out["before_stock_yamux"] = run("stock", a.size_mb)
    out["after_tuned_yamux"] = run("single", a.size_mb)
    out["loadavg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
