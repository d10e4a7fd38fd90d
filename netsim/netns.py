"""Network namespaces + `tc netem` for the process back-end (Linux, root only).

Layout: one hub namespace holding a bridge, one namespace per node with a veth pair into
the hub (`eth0`, 10.77.X.Y/16). Nothing is added to the machine's own namespace, and
teardown deletes every namespace it made (which deletes the veths).

Shaping, on every node's `eth0` egress: a `prio` root with three bands, each a netem:
  1:1  default — the scenario's latency / rate / loss (every packet goes here unless a filter says otherwise)
  1:2  slow    — a `slow_link` fault's conditions, for packets to the other end of that link
  1:3  drop    — loss 100%, for packets to the other side of a partition (like a cut cable:
       TCP retransmits and stalls until the partition heals)
u32 filters on the destination address pick bands 1:2 / 1:3 (partition filters are
evaluated first). One slow-link setting per node: a second slow link from the same node
replaces the first one's conditions.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

from netsim.scenario import NetworkSpec


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


def netns_available() -> tuple[bool, str]:
    """(True, "") when this process can make namespaces, veths and netem; else (False, why)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed"
    probe = f"atdprobe{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`ip netns add` fails: {getattr(exc, 'stderr', '') or exc}".strip()
    try:
        _run("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _run("ip", "-n", probe, "link", "set", "p0", "up")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return False, f"veth / netem not usable: {(getattr(exc, 'stderr', '') or str(exc)).strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return True, ""


def _netem(latency_ms: float, bandwidth_mbps: float | None, loss: float) -> list[str]:
    args = ["netem", "delay", f"{latency_ms:g}ms"]
    if bandwidth_mbps:
        args += ["rate", f"{bandwidth_mbps:g}mbit"]
    if loss:
        args += ["loss", f"{loss * 100:g}%"]
    return args


class NetnsLab:
    """The namespaces of one run (names derive from the pid, so two runs never collide)."""

    def __init__(self, names: list[str], *, seed: int, network: NetworkSpec) -> None:
        self.names = list(names)
        self.spec = network
        tag = f"atd{os.getpid() % 100000}"
        self.hub = f"{tag}hub"
        self.ns = {n: f"{tag}n{i}" for i, n in enumerate(self.names)}
        self._ip = {n: f"10.77.{i // 250}.{i % 250 + 1}" for i, n in enumerate(self.names)}
        self._made: list[str] = []
        self._slow: dict[str, str] = {}  # node -> peer whose packets use band 1:2

    def describe(self) -> str:
        s = self.spec
        return (f"{len(self.names)} namespaces on a private bridge, netem delay {s.latency_ms:g} ms"
                + (f", rate {s.bandwidth_mbps:g} Mbit/s" if s.bandwidth_mbps else "")
                + (f", loss {s.loss:.1%}" if s.loss else "") + " per direction")

    def ip(self, name: str) -> str:
        return self._ip[name]

    def wrap(self, name: str, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name], *args]

    def setup(self) -> None:
        try:
            _run("ip", "netns", "add", self.hub)
            self._made.append(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            d = self.spec
            for i, n in enumerate(self.names):
                ns = self.ns[n]
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
                _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}", "netns",
                     self.hub)
                _run("ip", "-n", ns, "addr", "add", f"{self._ip[n]}/16", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", f"v{i}", "up")
                _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "prio", "bands", "3",
                     "priomap", *(["0"] * 16))
                base = _netem(d.latency_ms, d.bandwidth_mbps, d.loss)
                _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:", *base)
                _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "parent", "1:2", "handle", "20:", *base)
                _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "parent", "1:3", "handle", "30:", "netem",
                     "loss", "100%")
        except Exception:
            self.teardown()
            raise

    def teardown(self) -> None:
        for ns in reversed(self._made):
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()

    def _filter(self, node: str, dst: str, band: str, prio: str) -> None:
        _run("tc", "-n", self.ns[node], "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", prio,
             "u32", "match", "ip", "dst", f"{self._ip[dst]}/32", "flowid", band)

    def partition(self, groups: list[list[str]]) -> None:
        where = {n: i for i, g in enumerate(groups) for n in g}
        for a, ia in where.items():
            for b, ib in where.items():
                if ia != ib:
                    self._filter(a, b, "1:3", "1")

    def heal(self) -> None:
        for n in self.names:
            _run("tc", "-n", self.ns[n], "filter", "del", "dev", "eth0", "parent", "1:", "prio", "1", check=False)

    def set_link(self, a: str, b: str, *, latency_ms: float | None = None, bandwidth_mbps: float | None = None,
                 loss: float | None = None) -> None:
        d = self.spec
        args = _netem(d.latency_ms if latency_ms is None else latency_ms,
                      d.bandwidth_mbps if bandwidth_mbps is None else bandwidth_mbps,
                      d.loss if loss is None else loss)
        for x, y in ((a, b), (b, a)):
            _run("tc", "-n", self.ns[x], "qdisc", "change", "dev", "eth0", "parent", "1:2", "handle", "20:", *args)
            if self._slow.get(x) != y:
                _run("tc", "-n", self.ns[x], "filter", "del", "dev", "eth0", "parent", "1:", "prio", "2",
                     check=False)
                self._filter(x, y, "1:2", "2")
                self._slow[x] = y

    def counters(self, name: str) -> dict[str, int]:
        """Bytes through the node's interface (wire bytes: TCP/IP, Noise, yamux included)."""
        try:
            out = _run("ip", "-n", self.ns[name], "-j", "-s", "link", "show", "dev", "eth0").stdout
            st = json.loads(out)[0]["stats64"]
            return {"sent": int(st["tx"]["bytes"]), "received": int(st["rx"]["bytes"])}
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError):
            return {"sent": 0, "received": 0}
