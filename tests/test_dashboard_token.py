"""Issue 24 item 9: `--dashboard-public` serves nothing but /healthz without its read-only token
(a real daemon on the in-memory network, its dashboard on loopback marked public)."""
from __future__ import annotations

import ast
import dataclasses
import functools
import json
import urllib.error
import urllib.request
from pathlib import Path

import trio

from atdnode.node import NodeDaemon, NodeIdentity
from atdnode.report import Dashboard
from atdnode.report.dashboard.server import TOKEN_FILE
from atdnode.transport import MemoryNetwork, MemoryTransport
from tests.factories import make_consortium


def _get(url: str, headers: dict | None = None) -> tuple[int, str, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def test_a_public_dashboard_needs_its_read_only_token(tmp_path: Path) -> None:
    (home,) = make_consortium(tmp_path, 1)
    me = NodeIdentity.load(home).peer_id
    d = NodeDaemon(home, transport=MemoryTransport(MemoryNetwork(seed=3), NodeIdentity.load(home).signer.seed))
    web = Dashboard(home, d.store, d.snapshot, host="127.0.0.1", port=0, public=True)
    out: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(d.run, web=web), [], [])
            with trio.fail_after(30):
                while web.url is None:
                    await trio.sleep(0.05)
            url = web.url
            out["urls"] = (d.web_url, (await d.status())["dashboard"],
                           json.loads((home.root / "daemon.json").read_text())["dashboard"])
            snap = d.snapshot()
            snap.stats["gossip_in"] = -1  # a copy: the daemon's counters are untouched
            out["snapshot"] = (snap.peer_id, d.stats["gossip_in"])
            try:
                snap.peers = ("someone",)
                out["frozen"] = False
            except dataclasses.FrozenInstanceError:
                out["frozen"] = True
            token = (home.root / TOKEN_FILE).read_text().strip()
            out["token_mode"] = (home.root / TOKEN_FILE).stat().st_mode & 0o077
            for path in ("", "api/state", "metrics"):
                out[f"anon {path}"] = await trio.to_thread.run_sync(_get, url + path)
                out[f"wrong {path}"] = await trio.to_thread.run_sync(
                    _get, url + path, {"Authorization": "Bearer " + "x" * len(token)})
            out["health"] = await trio.to_thread.run_sync(_get, url + "healthz")
            out["bearer"] = await trio.to_thread.run_sync(_get, url + "api/state", {"Authorization": f"Bearer {token}"})
            out["link"] = await trio.to_thread.run_sync(_get, url + f"?token={token}")
            cookie = out["link"][2].get("set-cookie", "").split(";")[0]
            out["cookie"] = await trio.to_thread.run_sync(_get, url + "api/state", {"Cookie": cookie})
            d.stop()

    trio.run(main)
    assert out["token_mode"] == 0
    assert out["urls"] == (out["urls"][2],) * 3 and out["urls"][0].startswith("http://127.0.0.1:")
    assert out["snapshot"] == (me, 0) and out["frozen"]
    for path in ("", "api/state", "metrics"):
        for who in ("anon", "wrong"):
            code, body, _ = out[f"{who} {path}"]
            assert code == 401 and me not in body and "token" in body, (who, path)
    assert out["health"][0] == 200
    assert out["bearer"][0] == 200 and me in out["bearer"][1]  # the token holder sees the node
    assert out["link"][0] == 200 and "HttpOnly" in out["link"][2].get("set-cookie", "")
    assert out["cookie"][0] == 200 and me in out["cookie"][1]


def test_the_daemon_never_imports_the_dashboard() -> None:
    """Issue 28: the dashboard runs beside the daemon (`atd node start` wires them) and reads
    `NodeDaemon.snapshot()`; no module the daemon imports, at load time or deferred, is it."""
    root = Path(__file__).resolve().parent.parent

    def imports(module: str) -> set[str]:
        path = root / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = root / module.replace(".", "/") / "__init__.py"
        if not path.exists():
            return set()  # not ours
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        return {m for m in out if m.split(".")[0] in ("atdnode", "ledger", "protocols")}

    seen, todo = set(), ["atdnode.node.daemon"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports(m))
    assert "atdnode.node.daemon" in seen and "atdnode.replication.replicator" in seen  # the walk follows imports
    assert not {m for m in seen if m.startswith("atdnode.report.dashboard")}
