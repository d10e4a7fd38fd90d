"""`atd node start|status|stop`, `atd peers`, `atd fetch`: run and drive the daemon."""
from __future__ import annotations

import functools
import json
import logging
import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer

from atdnode.node import control
from atdnode.errors import ConfigError
from atdnode.node import NodeHome
from cli.options import HOME_OPT, node_home

node_app = typer.Typer(help="Run the node daemon and ask it how it is doing.", no_args_is_help=True)


@node_app.command("start")
def start(
    home: Path = HOME_OPT,
    listen: List[str] = typer.Option([], "--listen", help="Multiaddr to listen on (repeatable; default: `listen` in "
                                     "config.toml, which defaults to /ip4/127.0.0.1/tcp/0)."),
    bootstrap: List[str] = typer.Option([], "--bootstrap", help="Full multiaddr (…/p2p/<id>) of a peer to dial "
                                        "(repeatable; added to `bootstrap` in config.toml)."),
    announce: List[str] = typer.Option([], "--announce", help="Multiaddr other sites dial, e.g. /ip4/PUBLIC_IP/tcp/4001 "
                                       "behind NAT (repeatable; replaces `network.announce` in config.toml; default: "
                                       "the listen addresses, 0.0.0.0 as this host's interface addresses)."),
    role: Optional[str] = typer.Option(None, "--role", help="Announce a role in the hello entry (e.g. festa-server)."),
    sync_interval: float = typer.Option(10.0, help="Seconds between periodic ledger syncs with every peer."),
    no_auto_fetch: bool = typer.Option(False, "--no-auto-fetch", help="Do not fetch announced blobs automatically."),
    dashboard: Optional[str] = typer.Option(None, "--dashboard", help="Serve the read-only web dashboard, /metrics and /healthz on HOST:PORT (loopback only unless --dashboard-public; port 0 picks one)."),
    dashboard_public: bool = typer.Option(False, "--dashboard-public", help="Allow --dashboard on a non-loopback address (put it behind your own TLS and access control)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log only to HOME/logs/daemon.log (rotated by size; "
                               "[logs] max_bytes / backups in config.toml), not to stderr."),
) -> None:
    """Run the daemon in the foreground until Ctrl-C / SIGTERM.

    Settings not given as options come from HOME/config.toml (listen, bootstrap, role), so a
    service manager can run just `atd node start --home DIR`. Prints each address others
    dial (with /p2p/<peer id>; never 0.0.0.0) on stdout once the node is ready; the dashboard's URL goes to the
    log, to HOME/daemon.json and to `atd node status`. Malformed addresses (options or
    config.toml) are refused before anything starts; a bootstrap peer that cannot be reached
    is logged at its first failed dial (or after 5 s of a dial that hangs).
    """
    import trio

    from atdnode.node import NodeConfig, check_announce, check_bootstrap, check_listen
    from atdnode.node import NodeDaemon, setup_logging, sklearn_warnings_to_log

    h = node_home(home)
    bind = None
    if dashboard is not None:
        from atdnode.report import check_free, parse_bind

        bind = parse_bind(dashboard, public=dashboard_public)
        check_free(*bind)
    cfg = NodeConfig.load(h)
    # checked at once, before anything starts: one line naming the bad address and its source
    src = str(h.config_file)
    listen = [check_listen(a, "--listen") for a in listen] or [check_listen(a, f"{src} listen") for a in cfg.listen]
    if not listen:
        raise ConfigError(f"{src} listen: no address to listen on")
    bootstrap = list(dict.fromkeys([*(check_bootstrap(a, "--bootstrap") for a in bootstrap),
                                    *(check_bootstrap(a, f"{src} bootstrap") for a in cfg.bootstrap)]))
    announce = [check_announce(a, "--announce") for a in announce] or cfg.announce()
    setup_logging(h, "daemon", verbose=verbose, stderr=not quiet)
    sklearn_warnings_to_log()  # scikit-learn's warnings join the daemon's log
    # its listen failures end the start as one `error:` line (Libp2pTransport re-raises them)
    logging.getLogger("libp2p.transport.tcp.tcp").setLevel(logging.CRITICAL)
    if role is not None:
        cfg.role = role
        cfg.save(h)
    # the daemon outlives this command's handle: it gets the plain home, opens its own ledger and
    # store, and reads config.toml again where a setting may change while it runs
    daemon = NodeDaemon(NodeHome(h.root), sync_interval=sync_interval, auto_fetch=not no_auto_fetch)
    web = None
    if bind is not None:  # read-only web page + /metrics + /healthz beside the daemon (atdnode.report.dashboard)
        from atdnode.report import Dashboard

        web = Dashboard(daemon.home, daemon.store, daemon.snapshot, host=bind[0], port=bind[1], public=dashboard_public)

    async def main() -> None:
        listening = trio.CancelScope()

        async def on_signals() -> None:
            with listening, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    daemon.stop()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signals)
            addrs = await nursery.start(functools.partial(daemon.run, web=web, announce=announce), list(listen), list(bootstrap))
            for a in addrs:
                typer.echo(a)
            sys.stdout.flush()
            await daemon.stopped()
            listening.cancel()  # (a stop over the control socket leaves it listening); `run` then ends
            # by itself after its clean stop (announced seq saved, daemon.json removed, ledger closed)

    try:
        trio.run(main)
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _log_to_file_only(exc)
        raise


def _log_to_file_only(exc: BaseException) -> None:
    """The traceback of what stopped the daemon goes to HOME/logs/daemon.log, for IT; stderr
    keeps its one `error:` line (cli.failure)."""
    crash = logging.getLogger("atd.daemon.stopped")
    crash.propagate = False
    crash.handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    crash.critical("daemon stopped by an error", exc_info=exc)


@node_app.command("status")
def status(home: Path = HOME_OPT, as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Addresses, peers, ledger heads and blobs of the running daemon (or the offline state)."""
    h = node_home(home)
    if control.daemon_running(h.control_socket):
        st = control.call(h.control_socket, "status")
        st.pop("ok", None)
        st["running"] = True
    else:
        st = _offline_status(h)
    if as_json:
        typer.echo(json.dumps(st, indent=2, default=str))
        return
    typer.echo(f"peer id : {st['peer_id']}")
    typer.echo(f"running : {st['running']}")
    for a in st.get("addrs", []):
        typer.echo(f"address : {a}")
    members = st.get("members")  # the other members (a running daemon's count)
    typer.echo(f"peers   : {len(st.get('peers', []))}" + (f" of {members} members connected" if members is not None else ""))
    for peer, secs in sorted(st.get("unreachable", {}).items()):  # after [peers] unreachable_after_s
        typer.echo(f"warning : member {peer} unreachable for {secs:.0f} s")
    typer.echo(f"ledger  : {st['ledger']['entries']} entries from {len(st['ledger']['heads'])} authors")
    typer.echo(f"blobs   : {st['blobs']}")
    if st.get("dashboard"):
        typer.echo(f"web     : {st['dashboard']}")


def _offline_status(h: NodeHome) -> dict:
    from atdnode.blobs import BlobStore
    from atdnode.node import NodeIdentity
    from ledger import Ledger
    from ledger.keys import peer_id_from_public_key

    led = Ledger.open(h.ledger_db)
    try:
        heads = {peer_id_from_public_key(a): s for a, s in led.heads().items()}
    finally:
        led.close()
    return {
        "peer_id": NodeIdentity.load(h).peer_id,
        "running": False,
        "addrs": [],
        "peers": [],
        "ledger": {"heads": heads, "entries": sum(heads.values())},
        "blobs": len(BlobStore.of(h).list()),
    }


@node_app.command("stop")
def stop(home: Path = HOME_OPT) -> None:
    """Ask the running daemon to shut down cleanly."""
    control.call(node_home(home).control_socket, "stop")
    typer.echo("stopping")


def peers(home: Path = HOME_OPT) -> None:
    """List the peers the running daemon is connected to."""
    reply = control.call(node_home(home).control_socket, "peers")
    for p in reply["peers"]:
        typer.echo(p)


def fetch(
    home: Path = HOME_OPT,
    blob: str = typer.Argument(..., help="SHA-256 (hex) of the blob to fetch, or a unique prefix of one this node's "
                               "ledger announces."),
    timeout: float = typer.Option(600.0, help="Give up after this many seconds."),
) -> None:
    """Fetch a blob from the peers that hold it (needs a running daemon). On a terminal a bar
    shows the bytes the daemon has recorded so far against the size the ledger announces."""
    from atdnode import progress
    from atdnode.blobs import BlobStore, partial_bytes
    from atdnode.node import resolve_blob
    from cli.progress import bars, while_polling

    h = node_home(home)
    blob = resolve_blob(h, blob)
    store = BlobStore.of(h)
    call = lambda: control.call(h.control_socket, "fetch", blob=blob, timeout_s=timeout, timeout=timeout + 30)  # noqa: E731
    with bars(), progress.task(f"fetch {blob[:12]}", total=announced_size(h, blob), unit="bytes") as step:
        got = lambda: partial_bytes(store, blob)  # noqa: E731
        reply = while_polling(call, lambda: step.update(min(got(), step.total) if step.total else got()))
        step.update(reply["size"])
    typer.echo(f"{reply['blob']} {reply['size']} bytes")


def announced_size(h: NodeHome, blob: str) -> int | None:
    """The size a ledger entry announces for `blob` (None if no entry names it)."""
    from ledger import Ledger

    with Ledger.open(h.ledger_db) as led:
        for kind in ("weights", "aggregate", "features"):
            for e in led.query(kind=kind):
                if e.body.get("blob") == blob and isinstance(e.body.get("size"), int):
                    return int(e.body["size"])
    return None


def register(app: typer.Typer) -> None:
    app.add_typer(node_app, name="node")
    app.command("peers")(peers)
    app.command("fetch")(fetch)
