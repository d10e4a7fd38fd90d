"""`--dashboard-public` serves nothing but /healthz and /login without its read-only token (a
real daemon on the in-memory network, its dashboard on loopback marked public); the token
is never taken from the URL, `Bearer` is matched in any case, and the login cookie is
Secure when the request came over TLS."""
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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _post(url: str, form: dict, headers: dict | None = None) -> tuple[int, str, dict]:
    from urllib.parse import urlencode

    req = urllib.request.Request(url, data=urlencode(form).encode(), headers=headers or {}, method="POST")
    try:
        with urllib.request.build_opener(_NoRedirect).open(req, timeout=30) as r:
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
            out["lower"] = await trio.to_thread.run_sync(_get, url + "api/state", {"Authorization": f"bearer {token}"})
            out["link"] = await trio.to_thread.run_sync(_get, url + f"api/state?token={token}")
            out["form"] = await trio.to_thread.run_sync(_get, url + "login")
            out["bad login"] = await trio.to_thread.run_sync(_post, url + "login", {"token": "x" * len(token)})
            out["login"] = await trio.to_thread.run_sync(_post, url + "login", {"token": token})
            out["tls login"] = await trio.to_thread.run_sync(_post, url + "login", {"token": token},
                                                             {"X-Forwarded-Proto": "https"})
            cookie = out["login"][2].get("set-cookie", "").split(";")[0]
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
    assert out["lower"][0] == 200 and me in out["lower"][1]  # RFC 7235: the scheme is case-insensitive
    assert out["link"][0] == 401 and me not in out["link"][1]  # never from the URL (it lands in logs)
    assert out["form"][0] == 200 and "<form" in out["form"][1]
    assert out["bad login"][0] == 401 and "set-cookie" not in out["bad login"][2]
    code, _, headers = out["login"]
    assert code == 303 and "HttpOnly" in headers["set-cookie"] and "Secure" not in headers["set-cookie"]
    assert out["tls login"][0] == 303 and "; Secure" in out["tls login"][2]["set-cookie"]
    assert out["cookie"][0] == 200 and me in out["cookie"][1]


def test_the_login_cookie_is_secure_over_tls() -> None:
    """Served over TLS (the ASGI scope's scheme is https), the cookie carries Secure."""
    from atdnode.report.dashboard.server import token_guard

    async def app(scope, receive, send):  # the dashboard behind the guard: never reached here
        raise AssertionError("the guard answered a login itself")

    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b"token=" + b"t" * 40, "more_body": False}

    async def main() -> None:
        guard = token_guard(app, "t" * 40)
        for scheme in ("https", "http"):
            await guard({"type": "http", "path": "/login", "method": "POST", "scheme": scheme, "headers": []},
                        receive, send)

    trio.run(main)
    cookies = [dict(m["headers"])[b"set-cookie"] for m in sent if m["type"] == "http.response.start"]
    assert len(cookies) == 2 and cookies[0].endswith(b"; Secure") and b"Secure" not in cookies[1]


def test_the_daemon_never_imports_the_dashboard() -> None:
    """The dashboard runs beside the daemon (`atd node start` wires them) and reads
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
                face = faces(node.module)  # a room's face: the module each name comes from (atdnode/face.py)
                out.update([node.module, *(f"{node.module}.{face.get(a.name, a.name)}" for a in node.names)])
        return {m for m in out if m.split(".")[0] in ("atdnode", "ledger", "protocols")}

    def faces(package: str) -> dict[str, str]:
        init = root / package.replace(".", "/") / "__init__.py"
        if not init.exists():
            return {}
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_FACE" for t in node.targets):
                return {name: spec.partition(":")[0] for name, spec in ast.literal_eval(node.value).items()}
        return {}

    seen, todo = set(), ["atdnode.node.daemon"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports(m))
    assert "atdnode.node.daemon" in seen and "atdnode.replication.replicator" in seen  # the walk follows imports
    assert not {m for m in seen if m.startswith("atdnode.report.dashboard")}
