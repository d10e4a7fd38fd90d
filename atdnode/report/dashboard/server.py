"""The daemon's read-only web dashboard, `/metrics` and `/healthz` (Starlette on hypercorn-trio).

`Dashboard.serve` runs beside the daemon (`atd node start` hands it to `NodeDaemon.run(...,
web=...)`), on its trio loop: hypercorn's trio worker (`hypercorn.trio.serve`) drives a
Starlette app. It never touches the daemon object: what only the running daemon knows comes
from its read-only `snapshot()` (`atdnode.node.snapshot.NodeSnapshot`); the ledger, the blob
store and the home's files it reads itself, in worker threads, so the loop never blocks.

Routes (GET only; anything else is 405; a public dashboard adds GET / POST /login):

    /                      the page (server-rendered HTML + CSS, no scripts, no CDN)
    /api/state             the same data as JSON
    /metrics               Prometheus text format (atdnode.report.dashboard.prom)
    /healthz               "ok" while the daemon runs
    /models/{id}/confusion.png, /classify/{name}.png   confusion matrices

What it shows is what `atd` commands already print (ids, membership, entry bodies' public
fields, model metrics); it never serves a blob, a key or an entry body beyond those.
Binding: loopback unless `public=True` (`--dashboard-public`); without it, requests whose
Host header names another host are refused (a DNS-rebinding page cannot read it). A public
dashboard serves only /healthz without its read-only token (`token_guard`, HOME/dashboard.token).

Aggregates are verified in the background with the function behind
`atd aggregate --verify` (`atdnode.aggregation.aggregate.verify_aggregate`), one at a time in a worker
thread; results are cached per entry id (a verified or failed entry is final; one whose
input blobs are not here yet is retried).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import time
from typing import Any, Callable

import trio

from atdnode.blobs import BlobStore
from atdnode.report.dashboard import prom, view
from atdnode.errors import ConfigError
from atdnode.node import FetchProgress, NodeHome, NodeSnapshot

log = logging.getLogger("atd.dashboard")
VERIFY_INTERVAL = 2.0


def parse_bind(text: str, *, public: bool = False) -> tuple[str, int]:
    """`HOST:PORT` (or `[v6]:PORT`, or a bare `PORT` meaning 127.0.0.1) -> (host, port).

    ConfigError for a malformed value, or a non-loopback host without `public`.
    """
    text = text.strip()
    host, sep, port_s = text.rpartition(":")
    if not sep:
        host, port_s = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"--dashboard {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8470") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--dashboard {text!r}: port out of range")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ConfigError(f"--dashboard {text!r}: the host must be an IP address") from None
    if not loopback and not public:
        raise ConfigError(f"--dashboard {host}: refusing to serve the dashboard beyond loopback "
                          "without --dashboard-public")
    return host, port


def host_guard(app, allowed: set[str]):
    """ASGI wrapper: 400 unless the request's Host names one of `allowed` (any port). A page
    on another site that rebinds its DNS name to 127.0.0.1 sends its own name: refused."""

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").strip().lower()
            name = host[: host.find("]") + 1] if host.startswith("[") else host.rsplit(":", 1)[0]
            if name not in allowed:
                body = b"invalid host header"
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


TOKEN_FILE = "dashboard.token"
TOKEN_COOKIE = "atd_dashboard_token"


def public_token(root) -> str:
    """The read-only token of a `--dashboard-public` dashboard: HOME/dashboard.token (mode
    0600), made on first use. Whoever may read the dashboard gets it from the operator."""
    import os
    import secrets
    from pathlib import Path

    path = Path(root) / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if len(token) >= 32:
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


LOGIN_PATH = "/login"
MAX_LOGIN_BODY = 4096  # bytes of a login form accepted


def _login_form(failed: bool) -> bytes:
    note = "<p>wrong token</p>" if failed else ""
    return ("<!doctype html><title>atd dashboard</title><form method=post action=/login>"
            f"{note}<label>read-only token (HOME/dashboard.token) <input name=token type=password "
            "autocomplete=off autofocus></label> <button>open</button></form>").encode()


def _secure(scope, headers: dict) -> bool:
    """Whether the request came over TLS (here, or at a proxy that says so): the cookie is
    then marked Secure. Trusting the proxy's header only ever adds the flag."""
    return scope.get("scheme") in ("https", "wss") or \
        headers.get(b"x-forwarded-proto", b"").split(b",")[0].strip().lower() == b"https"


def token_guard(app, token: str):
    """ASGI wrapper for a public dashboard: every route but /healthz and /login answers 401
    unless the request carries the read-only token -- `Authorization: Bearer <token>` (the
    scheme matched case-insensitively, RFC 7235) or the cookie that `POST /login` (a form
    field `token`; `GET /login` shows the form) sets: HttpOnly, SameSite=Strict, and Secure
    when the request came over TLS. The token is never taken from the URL (a query string
    lands in access logs, proxies' logs and browser history). Without it a stranger learns
    nothing of the members, addresses, entries or blobs."""
    import hmac
    from urllib.parse import parse_qs

    want = token.encode()

    async def respond(send, status: int, body: bytes, extra: list | None = None, kind=b"text/plain") -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode()),
                                *(extra or [])]})
        await send({"type": "http.response.body", "body": body})

    async def login(scope, receive, send, headers: dict) -> None:
        if scope.get("method") == "GET":
            return await respond(send, 200, _login_form(False), kind=b"text/html; charset=utf-8")
        if scope.get("method") != "POST":
            return await respond(send, 405, b"method not allowed", [(b"allow", b"GET, POST")])
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > MAX_LOGIN_BODY:
                return await respond(send, 413, b"login form too large")
            if not msg.get("more_body"):
                break
        given = parse_qs(body.decode("latin-1")).get("token", [""])[0].strip().encode("latin-1", "replace")
        if not hmac.compare_digest(given, want):
            return await respond(send, 401, _login_form(True), kind=b"text/html; charset=utf-8")
        flags = "; Secure" if _secure(scope, headers) else ""
        cookie = f"{TOKEN_COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/{flags}".encode()
        await respond(send, 303, b"", [(b"location", b"/"), (b"set-cookie", cookie)])

    async def guarded(scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/healthz":
            return await app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if scope.get("path") == LOGIN_PATH:
            return await login(scope, receive, send, headers)
        auth = headers.get(b"authorization", b"")
        cookies = dict(c.strip().split("=", 1) for c in headers.get(b"cookie", b"").decode("latin-1").split(";")
                       if "=" in c)
        scheme, _, credentials = auth.partition(b" ")
        given = [credentials.strip() if scheme.lower() == b"bearer" else b"", cookies.get(TOKEN_COOKIE, "").encode()]
        if not any(hmac.compare_digest(g, want) for g in given):
            await respond(send, 401, b"this dashboard needs its read-only token (see HOME/dashboard.token on the "
                                     b"node): open /login, or send Authorization: Bearer TOKEN",
                          [(b"www-authenticate", b"Bearer")])
            return
        return await app(scope, receive, send)

    return guarded


def check_free(host: str, port: int) -> None:
    """ConfigError now (one line in the CLI) if HOST:PORT cannot be bound, rather than from
    inside the daemon's nursery later."""
    import socket

    if port == 0:
        return
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"--dashboard {host}:{port}: cannot bind ({exc.strerror or exc})") from None
    finally:
        s.close()


class Dashboard:
    """Serves one daemon's dashboard: construct with the node's home, its blob store and its
    `snapshot` (e.g. `NodeDaemon.snapshot`), then `nursery.start(serve)` (or pass it to
    `NodeDaemon.run(..., web=...)`)."""

    def __init__(self, home: NodeHome, store: BlobStore, snapshot: Callable[[], NodeSnapshot], *,
                 host: str = "127.0.0.1", port: int = 0, public: bool = False) -> None:
        self.home, self.store, self.snapshot = home, store, snapshot
        self.host, self.port, self.public = host, port, public
        self.url: str | None = None
        self.verify: dict[str, dict] = {}  # aggregate entry id -> {"status": ..., "detail": ...}
        self.started = time.time()
        self._verify_limiter = trio.CapacityLimiter(1)
        self._view_limiter = trio.CapacityLimiter(2)
        self._ledger = None  # its own read connection (WAL): page loads never hold up the daemon's merges
        self._ledger_limiter = trio.CapacityLimiter(1)

    async def read(self, fn):
        """`fn(ledger)` in a worker thread on the dashboard's own ledger connection."""
        from ledger import Ledger

        def call():
            if self._ledger is None:
                self._ledger = Ledger.open(self.home.ledger_db)
            return fn(self._ledger)

        return await trio.to_thread.run_sync(call, limiter=self._ledger_limiter)

    # ------------------------------------------------------------------ data

    async def state(self) -> dict[str, Any]:
        me = self.snapshot().public_key
        led = await self.read(lambda led: view.ledger_view(led, me))
        models = await trio.to_thread.run_sync(view.models_view, self.home, limiter=self._view_limiter)
        split = await trio.to_thread.run_sync(view.split_view, self.home, limiter=self._view_limiter)
        now = time.time()
        for e in led["timeline"]:
            e["verified"] = True  # in the log: signature, hash chain and membership checked on merge
        snap = self.snapshot()  # taken after the reads above: connections as they are now
        connected = set(snap.peers)
        for m in led["members"]:
            m["connected"] = m["peer_id"] in connected
            # a member that announced addresses should be reachable: not connected is a warning
            m["expected"] = not (m["me"] or m["revoked"] or m.get("rotated_to")) and bool(m["addrs"])
        for a in led["aggregates"]:
            a["verify"] = self.verify.get(a["id"], {"status": "pending", "detail": "not checked yet"})
        blobs = [p["blob"] for p in led["published"] if p["blob"]]
        held = await trio.to_thread.run_sync(lambda: {b for b in blobs if self.store.has(b)},
                                             limiter=self._view_limiter)
        for p in led["published"]:
            p["held"] = p["blob"] in held
        return {
            "node": {"peer_id": snap.peer_id, "name": snap.name, "role": snap.role,
                     "addrs": list(snap.addrs), "peers": sorted(connected), "started": self.started,
                     "now": now},
            **led, "models": models, "split": split,
            "campaigns": [dataclasses.asdict(c) for c in snap.campaigns],
            "fetches": self.fetches(snap.fetches, led["published"] + led["aggregates"]),
            "wanted": len(snap.wanted),
            "bytes_by_peer": snap.bytes_by_peer,
        }

    def fetches(self, started: tuple[FetchProgress, ...], announced: list[dict]) -> list[dict]:
        """Running fetches (started, blob not stored yet) with bytes so far and the announced size."""
        sizes = {a["blob"]: a.get("size") for a in announced if a.get("blob")}
        out = []
        for rep in started:
            blob = rep.blob
            if self.store.has(blob):
                continue
            size = sizes.get(blob) or 0
            out.append({"blob": blob, "bytes": rep.bytes, "size": size,
                        "fraction": (rep.bytes / size) if size else None, "holders": list(rep.holders),
                        "modes": dict(rep.modes)})
        return out

    async def metrics_text(self) -> str:
        def counts(led) -> dict:
            m = led.membership()
            members: dict[str, int] = {"active": 0, "revoked": 0}
            for s in m.members.values():
                members["revoked" if s.revoked else "active"] += 1
            return {"members": members, "ledger_states": led.stats(), "kinds": led.kind_counts(),
                    "consortium": m.consortium}

        c = await self.read(counts)
        from atdnode.blobs import BULK_BYTES

        snap = self.snapshot()
        by_proto = dict(snap.bytes_by_protocol)
        if BULK_BYTES.by_protocol:
            by_proto["bulk"] = tuple(BULK_BYTES.by_protocol.get("bulk", (0, 0)))
        else:
            by_proto.setdefault("bulk", (0, 0))
        agg: dict[str, int] = {}
        for v in self.verify.values():
            agg[v["status"]] = agg.get(v["status"], 0) + 1
        blobs = await trio.to_thread.run_sync(lambda: len(self.store.list()), limiter=self._view_limiter)
        now = self.snapshot()  # after the reads above: counters as they are now
        values = {"peer_id": now.peer_id, "peers": list(now.peers), **c,
                  "bytes_by_protocol": by_proto, "fetches": self.fetches(now.fetches, []), "wanted": len(now.wanted),
                  "blobs": blobs, "stats": dict(now.stats), "aggregates": agg}
        return prom.render(prom.node_families(values))

    # ------------------------------------------------------------------ verify

    async def verify_loop(self) -> None:
        from atdnode.aggregation import AggregateError, verify_aggregate
        from atdnode.errors import AtdError
        from ledger.errors import LedgerError

        home = self.home

        def todo(led) -> list[tuple[str, list[str]]]:
            out = []
            for e in led.query(kind="aggregate"):
                if self.verify.get(e.id.hex(), {}).get("status") in ("verified", "failed"):
                    continue
                blobs = []
                for h in e.body.get("inputs") or []:
                    try:
                        src = led.get(h)
                    except (TypeError, ValueError):
                        src = None
                    blobs.append(str(src.body.get("blob")) if src is not None else "")
                out.append((e.id.hex(), blobs))
            return out

        while True:
            for entry_id, blobs in await self.read(todo):
                try:
                    result = await trio.to_thread.run_sync(verify_aggregate, home, entry_id,
                                                           limiter=self._verify_limiter)
                    self.verify[entry_id] = {"status": "verified", "detail": f"recomputed {result[:16]}"}
                except (AggregateError, AtdError, LedgerError) as exc:
                    held = all(b and self.store.has(b) for b in blobs)
                    status = "failed" if held else "waiting"
                    self.verify[entry_id] = {"status": status, "detail": str(exc)}
                except Exception as exc:  # a bug in one verification must not stop the dashboard
                    log.exception("verifying aggregate %s", entry_id[:12])
                    self.verify[entry_id] = {"status": "failed", "detail": f"{type(exc).__name__}: {exc}"}
            await trio.sleep(VERIFY_INTERVAL)

    # ------------------------------------------------------------------ http

    def app(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route

        from atdnode.report.dashboard.page import render_page

        async def index(request: Request) -> Response:
            return HTMLResponse(render_page(await self.state()))

        async def api_state(request: Request) -> Response:
            return JSONResponse(await self.state())

        async def metrics(request: Request) -> Response:
            return Response(await self.metrics_text(), media_type=prom.CONTENT_TYPE)

        async def healthz(request: Request) -> Response:
            return PlainTextResponse("ok")

        async def png(path) -> Response:
            if path is None:
                return PlainTextResponse("not found", status_code=404)
            return FileResponse(path, media_type="image/png")

        async def confusion(request: Request) -> Response:
            mid = request.path_params["model_id"]
            return await png(await trio.to_thread.run_sync(view.confusion_path, self.home, mid))

        async def classify_png(request: Request) -> Response:
            name = request.path_params["name"]
            return await png(await trio.to_thread.run_sync(view.classify_png, self.home, name))

        routes = [Route("/", index), Route("/api/state", api_state), Route("/metrics", metrics),
                  Route("/healthz", healthz), Route("/models/{model_id}/confusion.png", confusion),
                  Route("/classify/{name}", classify_png)]
        app = Starlette(routes=routes)
        if self.public:  # anyone can reach it: only holders of the read-only token read it
            return token_guard(app, public_token(self.home.root))
        me = f"[{self.host}]" if ":" in self.host else self.host
        return host_guard(app, {"127.0.0.1", "localhost", "[::1]", me})

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the URL through `task_status`, serve until cancelled."""
        from hypercorn.config import Config
        from hypercorn.trio import serve

        cfg = Config()
        host = f"[{self.host}]" if ":" in self.host else self.host
        cfg.bind = [f"{host}:{self.port}"]
        cfg.accesslog = None
        cfg.errorlog = logging.getLogger("atd.dashboard.http")
        cfg.graceful_timeout = 1.0
        try:
            async with trio.open_nursery() as nursery:
                try:
                    binds = await nursery.start(lambda task_status: serve(self.app(), cfg, task_status=task_status))
                except OSError as exc:
                    raise ConfigError(f"cannot serve the dashboard on {self.host}:{self.port}: {exc}") from None
                self.url = binds[0].rstrip("/") + "/"
                nursery.start_soon(self.verify_loop)
                log.info("dashboard on %s", self.url)
                task_status.started(self.url)
        finally:
            if self._ledger is not None:
                self._ledger.close()
