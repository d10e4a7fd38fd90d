"""deploy/: the systemd unit runs a daemon configured by config.toml alone; the unit is
valid for systemd; the container file runs the same command; PORTS.md's config parses and
its firewall rules open exactly the ports it plans."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

from atdnode.node import NodeConfig, NodeHome, NodeIdentity
from tests.mdblocks import fenced_blocks
from tests.factories import make_consortium
from tests.nodeprocs import ATD, atd, live_status, spawn_daemon, start_daemon, wait_until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def unit() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (DEPLOY / "atd.service").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def blocks(md: str, lang: str) -> list[str]:
    return [body for info, body in fenced_blocks(md) if info.split()[:1] == [lang]]


def test_unit_is_hardened_and_valid() -> None:
    u = unit()
    argv = shlex.split(u["ExecStart"][0])
    # `atd` is looked up on the unit's PATH (a venv or a system pip), not at one fixed place
    assert argv[:2] == ["/usr/bin/env", "atd"] and argv[2:5] == ["node", "start", "--home"] and len(argv) == 8
    assert argv[6] == "--dashboard" and argv[7].startswith("127.0.0.1:")  # /healthz, loopback only
    path = dict(e.split("=", 1) for e in u["Environment"])["PATH"].split(":")
    assert path[0] == "/opt/atd/bin" and {"/usr/local/bin", "/usr/bin"} <= set(path)
    for key, want in (("User", "atd"), ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                      ("PrivateTmp", "yes"), ("ProtectHome", "yes"), ("UMask", "0077"), ("KillSignal", "SIGTERM"),
                      ("StateDirectory", "atd"), ("StateDirectoryMode", "0700")):
        assert u[key] == [want], key
    assert argv[5].startswith(u["ReadWritePaths"][0])  # the home is the only writable place
    assert u["ReadWritePaths"][0] == "/var/lib/" + u["StateDirectory"][0]  # ... and systemd creates it
    for doc in u.get("Documentation", []):  # only what exists after `pip install`
        assert not doc.startswith("file:"), doc
    recipe = (DEPLOY / "atd.service").read_text()
    assert "useradd --system --create-home --home-dir /var/lib/atd" in recipe  # `atd init` before the first start
    if shutil.which("systemd-analyze"):  # systemd's own parser: no unknown keys or bad values
        text = (DEPLOY / "atd.service").read_text()
        test_unit = Path("/tmp") / f"atd-unit-check-{id(text)}.service"
        test_unit.write_text(text)
        try:
            p = subprocess.run(["systemd-analyze", "verify", str(test_unit)], capture_output=True, text=True, timeout=60)
        finally:
            test_unit.unlink()
        assert p.returncode == 0 and p.stderr.strip() == "", p.stderr
    else:  # no systemd here: at least every line is a section, a comment or KEY=VALUE
        for line in (DEPLOY / "atd.service").read_text().splitlines():
            s = line.strip()
            assert not s or s.startswith(("#", ";")) or re.fullmatch(r"\[[A-Za-z]+\]", s) or re.match(r"[A-Za-z]+=", s), line


@pytest.mark.slow  # an atd process
def test_unit_finds_atd_on_its_path(tmp_path: Path) -> None:
    """The ExecStart lookup, run as systemd runs it: with only the unit's PATH (plus a venv
    standing in for /opt/atd/bin), `/usr/bin/env atd` finds this checkout's `atd`."""
    venv_bin = tmp_path / "opt-atd-bin"
    venv_bin.mkdir()
    (venv_bin / "atd").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cli.app "$@"\n')
    (venv_bin / "atd").chmod(0o755)
    u = unit()
    path = dict(e.split("=", 1) for e in u["Environment"])["PATH"].replace("/opt/atd/bin", str(venv_bin))
    argv = shlex.split(u["ExecStart"][0])
    p = subprocess.run([*argv[:2], "--help"], env={"PATH": path, "PYTHONPATH": str(DEPLOY.parent)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Set up a node" in p.stdout, p.stderr


@pytest.mark.slow  # atd and daemons as OS processes
def test_unit_command_starts_a_daemon_from_config_toml(tmp_path: Path) -> None:
    """The ExecStart line (no --listen, no --bootstrap) with this test's home: the daemon
    listens and dials where config.toml says (loopback here) and answers /healthz on the
    unit's loopback dashboard (port 0 here: a free one)."""
    a, b = (h.root for h in make_consortium(tmp_path, 2))  # what `atd init` and `atd member add` do
    first = start_daemon(a)
    cfg = NodeConfig.load(NodeHome.at(b))
    cfg.listen, cfg.bootstrap = ["/ip4/127.0.0.1/tcp/0"], [first.addrs[0]]
    cfg.save(NodeHome.at(b))
    argv = shlex.split(unit()["ExecStart"][0])
    assert argv[2:5] == ["node", "start", "--home"]
    rest = [re.sub(r":\d+$", ":0", a) for a in argv[6:]]  # --dashboard 127.0.0.1:0
    second = spawn_daemon(b, *rest)  # `atd node start --home b ...` exactly as the unit runs it
    assert second.proc.args[:len(ATD)] == ATD and second.proc.args[len(ATD):] == ["node", "start", "--home", str(b), *rest]
    try:
        addr = second.wait_ready(120)[0]
        assert addr.startswith("/ip4/127.0.0.1/tcp/")
        peer_a = NodeIdentity.load(NodeHome.at(a)).peer_id
        # polled over b's control socket in-process (an `atd` start-up per poll costs ~0.7 s of CPU);
        # what `atd peers` prints is checked once the connection is there
        wait_until(lambda: peer_a in live_status(b)["peers"], 60, "b to dial a from config.toml")
        assert peer_a in atd("peers", "--home", str(b)).stdout
        url = json.loads(atd("node", "status", "--home", str(b), "--json").stdout)["dashboard"]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=30) as r:
            assert r.status == 200
    finally:
        second.stop()
        first.stop()
    assert second.proc.returncode == 0


def test_containerfile_runs_the_same_command() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["atd"\]$', text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M).group(1)
    import json

    argv = json.loads(cmd)
    assert argv == shlex.split(unit()["ExecStart"][0])[2:]  # the unit's command, /healthz included
    assert "/healthz" in text.split("HEALTHCHECK", 1)[1]
    assert re.search(r"^USER atd$", text, re.M) and "VOLUME" in text
    for pkg in ("atdnode", "ledger", "protocols", "cli", "netsim"):  # every package pyproject installs
        assert f"COPY {pkg} ./{pkg}" in text


def test_port_plan_config_and_firewall_rules_agree() -> None:
    md = (DEPLOY / "PORTS.md").read_text()
    (toml_block,) = blocks(md, "toml")
    cfg = NodeConfig.from_dict(tomllib.loads(toml_block))  # the shown config is valid
    port = int(cfg.listen[0].rsplit("/", 1)[1])
    assert [a.split("/")[4] for a in cfg.announce()] == [str(port)]  # others dial the port it listens on
    lo, hi = map(int, re.search(r'ip_local_port_range="(\d+) (\d+)"', md).groups())
    (nft,) = blocks(md, "nftables")
    (ufw,) = [b for b in blocks(md, "sh") if b.startswith("ufw")]
    nft_ports = set(re.findall(r"@members tcp dport (\S+) accept", nft))
    assert nft_ports == {str(port), f"{lo}-{hi}"}
    members = re.search(r"elements = \{ (.*?) \}", nft).group(1).split(", ")
    ufw_rules = set(re.findall(r"allow from (\S+) to any port (\S+) proto tcp", ufw))
    assert ufw_rules == {(m, p) for m in members for p in (str(port), f"{lo}:{hi}")}
    assert "8470" not in nft + ufw  # the dashboard is never opened
    assert "policy drop" in nft and "ufw default deny incoming" in ufw
    if shutil.which("nft"):
        p = subprocess.run(["nft", "-c", "-f", "-"], input=nft, capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr


def test_keys_procedure_names_the_key_commands() -> None:
    md = (DEPLOY / "KEYS.md").read_text()
    for cmd in ("atd key export --encrypted", "atd key import", "atd key rotate", "atd member revoke",
                "atd member add"):
        assert cmd in md
