"""Daemon memory under a slow-loris / oversized-frame / blob-slot-hog attack by a member.

    python bench/attack_bench.py [--duration 20] [--sync-streams 255]

Starts one `atd node start` daemon (a real OS process, libp2p on 127.0.0.1) and an admitted
member running `netsim.attacker` against it (255 sync streams announcing 2 MiB then silent,
oversized headers, a 2 MiB frame of empty maps, 32 idle blob streams). Samples the daemon's
RSS every 0.25 s. Prints JSON: RSS before the attack (baseline, same run), peak RSS during
it (and the kernel's high-water mark), their ratio, and the attacker's counters: the
daemon's memory must stay bounded by its buffers, not grow with the attack.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nodeprocs import ATD, _env, atd, atd_json, start_daemon  # noqa: E402


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def consortium(root: Path) -> tuple[Path, Path]:
    """A founder (the victim) and one admitted member (the attacker)."""
    victim, evil = root / "victim", root / "evil"
    atd("init", "--home", str(victim), "--genesis", "--consortium", "bench")
    genesis = atd_json("ledger", "show", "--home", str(victim), "--kind", "genesis", "--json")[0]["id"]
    atd("init", "--home", str(evil), "--join", genesis)
    atd("member", "add", "--home", str(victim), atd("id", "--home", str(evil)).stdout.strip())
    return victim, evil


def start_attacker(evil: Path, targets: list[str], duration: float, sync_streams: int, blob_streams: int) -> subprocess.Popen:
    from atdnode.node import NodeHome, NodeIdentity

    seed = NodeIdentity.load(NodeHome.at(evil)).signer.seed.hex()
    args = [sys.executable, "-m", "netsim.attacker", "--seed", seed, "--duration", str(duration),
            "--sync-streams", str(sync_streams), "--blob-streams", str(blob_streams)]
    for t in targets:
        args += ["--target", t]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if '"ready"' not in first:
        raise RuntimeError(f"attacker did not start: {first!r}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--sync-streams", type=int, default=255)
    ap.add_argument("--blob-streams", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        victim, evil = consortium(Path(tmp))
        d = start_daemon(victim)
        try:
            time.sleep(3)
            baseline = rss_mb(d.pid)
            att = start_attacker(evil, d.addrs, args.duration, args.sync_streams, args.blob_streams)
            peak, t0 = baseline, time.monotonic()
            while att.poll() is None and time.monotonic() - t0 < args.duration + 30:
                peak = max(peak, rss_mb(d.pid))
                time.sleep(0.25)
            out, _ = att.communicate(timeout=30)
            hwm = rss_mb(d.pid, "VmHWM")
            alive = d.alive()
        finally:
            d.stop()
    stats = json.loads(out.strip().splitlines()[-1])
    print(json.dumps({
        "slowloris_rss": {"baseline_mb": round(baseline, 1), "peak_mb": round(peak, 1), "hwm_mb": round(hwm, 1),
                          "ratio_peak_to_baseline": round(peak / baseline, 3), "duration_s": args.duration,
                          "sync_streams": args.sync_streams, "blob_streams": args.blob_streams,
                          "daemon_alive": alive, "attacker": stats,
                          "before_issue_11": {"baseline_mb": 134, "peak_mb": 3270}},
        "machine": {"python": sys.version.split()[0]},
    }, indent=2))


if __name__ == "__main__":
    main()
