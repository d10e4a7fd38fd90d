"""The daemon's web dashboard, /metrics and /healthz, checked in a real headless Chromium.

Three real daemons (OS processes on 127.0.0.1) run over homes that trained, published and
aggregated (vertical) in process; node a serves the dashboard. The browser loads the
page as a person would and the test reads what it shows: three members, two connected
peers, the aggregate marked verified (recomputed by the dashboard with the function behind
`atd aggregate --verify`) and the ensemble's metrics from `atd classify`. A screenshot is
kept under test-artifacts/ (gitignored). /metrics must parse with prometheus_client.
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from atdnode.blobs import BlobStore
from tests.browser import browser, text_of
from tests.nodeprocs import atd, start_daemon, wait_until
from tests.vgs_homes import DISJOINT, copy_homes

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def get(url: str, *, host: str | None = None, method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(url, method=method, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", ""), exc.read().decode(errors="replace")


@pytest.fixture
def disjoint(vgs_template, tmp_path):
    template = vgs_template("disjoint")
    return copy_homes(template, tmp_path / "homes")


def test_bind_rules() -> None:
    from atdnode.report import parse_bind
    from atdnode.errors import ConfigError

    assert parse_bind("127.0.0.1:8470") == ("127.0.0.1", 8470)
    assert parse_bind("8470") == ("127.0.0.1", 8470)
    assert parse_bind("localhost:0") == ("127.0.0.1", 0)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    for bad in ("0.0.0.0:8470", "10.1.2.3:80", "[::]:80"):
        with pytest.raises(ConfigError, match="--dashboard-public"):
            parse_bind(bad)
        assert parse_bind(bad, public=True)[1] in (8470, 80)
    for bad in ("127.0.0.1:http", "127.0.0.1:70000", "example.org:80"):
        with pytest.raises(ConfigError):
            parse_bind(bad)


@pytest.mark.slow  # atd as OS processes
def test_cli_refuses_a_public_bind_in_one_line(tmp_path) -> None:
    atd("init", "--home", str(tmp_path / "n"), "--genesis", "--consortium", "demo")
    proc = atd("node", "start", "--home", str(tmp_path / "n"), "--dashboard", "0.0.0.0:0", check=False, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "--dashboard-public" in proc.stderr
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = atd("node", "start", "--home", str(tmp_path / "n"), "--dashboard", f"127.0.0.1:{port}", check=False,
                   timeout=120)
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0 and "cannot bind" in proc.stderr


@pytest.mark.slow
def test_dashboard_in_a_real_browser(disjoint) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from atdnode.learning import run_classify as classify
    from atdnode.aggregation import EnsembleOptions
    from atdnode.aggregation.vertical import aggregate_vertical
    from atdnode.models import model_in_use

    a, b, c = disjoint
    res = aggregate_vertical(a, options=EnsembleOptions(pca_components=32, mlp_hidden=(64,), mlp_max_iter=120,
                                                        rf_trees=30))
    cls = classify(a, DISJOINT["a"], model=res.model_id)
    acc = cls.metrics["accuracy"]
    # a's three balanced classes: chance 1/3 (a constant predictor scores <= 36/107 here); measured 0.89.
    assert acc > 2 * (1 / 3)  # the page must show this number

    daemons = []
    try:
        d_a = start_daemon(a.root, "--dashboard", "127.0.0.1:0")
        daemons.append(d_a)
        state = wait_until(lambda: json.loads((a.root / "daemon.json").read_text()), 30, "daemon.json")
        url = state["dashboard"]
        assert url.startswith("http://127.0.0.1:")
        for h in (b, c):
            daemons.append(start_daemon(h.root, "--bootstrap", d_a.addrs[0]))

        def ready():
            s = json.loads(get(url + "api/state")[2])
            agg = [x for x in s["aggregates"] if x["id"] == res.entry.id.hex()]
            return len(s["node"]["peers"]) == 2 and agg and agg[0]["verify"]["status"] == "verified" and s
        s = wait_until(ready, 180, "two connected peers and the aggregate verified")
        # b and c fetch the aggregate's result from a (`atd fetch`: over the bulk channel)
        for h in (b, c):
            assert res.blob in atd("fetch", "--home", str(h.root), res.blob).stdout
            assert BlobStore(h.blobs_dir).has(res.blob)
        assert {m["name"] for m in s["members"]} == {"a", "b", "c"}

        dom = browser("--dump-dom", url)
        seen = text_of(dom)
        assert re.search(r"\b3 members\b", seen), seen[:500]
        assert re.search(r"\b2 of 2 members connected\b", seen)
        assert 'class="card warn"' not in dom and "peer-warning" not in dom
        row = re.search(r'<tr class="aggregate">.*?</tr>', dom, re.S).group(0)
        assert res.entry.id.hex()[:12] in row and "vertical" in row
        assert re.search(r'class="ok verify-status"[^>]*>verified<', row)
        model_row = next(r for r in re.findall(r'<tr class="model">.*?</tr>', dom, re.S) if res.model_id in r)
        assert f"accuracy {acc:.3f}" in text_of(model_row) and "<td>vertical</td>" in model_row
        assert f'<a class="cm-link" href="/classify/{cls.png.name}"' in model_row  # click: full size
        in_use = model_in_use(a).record.id  # the aggregate, or what its keep decision kept
        assert "default for atd classify" in next(r for r in re.findall(r'<tr class="model">.*?</tr>', dom, re.S)
                                                  if in_use in r)
        assert len(re.findall(r"default for atd classify", dom)) == 1
        bars = dict(re.findall(r'<g class="acc-bar" data-model="(\w+)" data-kind="(\w+)"', dom))
        assert bars[res.model_id] == "consortium" and "local" in bars.values()
        assert "extractor weights, 3 classes" in text_of(dom)  # what a published row carries
        assert str(a.root) not in dom  # no local paths (data specs show as their kind)
        assert set(re.findall(r'<g class="peer-bytes" data-peer="(\w+)"', dom)) == {"b", "c"}  # bytes per peer
        for name in ("a", "b", "c"):
            assert re.search(rf'<tr class="peer"><td>{name}<br>', dom)
        timeline = dom[dom.index('id="ledger"'):]
        shown = int(re.search(r'id="card-entries"><div class="n">(\d+)<', dom).group(1))
        assert shown >= s["entries"] and len(re.findall(r"✓ verified", dom)) == shown
        assert len(re.findall(r"<td>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d</td>", timeline)) == shown  # stored here

        status, ctype, _ = get(url + f"classify/{cls.png.name}")
        assert status == 200 and ctype == "image/png"
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        browser(f"--screenshot={shot}", "--window-size=1400,2200", url)
        assert shot.stat().st_size > 20_000

        status, ctype, body = get(url + "metrics")
        assert status == 200 and ctype.startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(body)}
        assert fams["atd_peers_connected"].samples[0].value == 2
        members = {smp.labels["state"]: smp.value for smp in fams["atd_members"].samples}
        assert members == {"active": 3, "revoked": 0}
        log = {smp.labels["state"]: smp.value for smp in fams["atd_ledger_entries"].samples}
        assert log["log"] >= shown and log["held"] == log["evidence"] == 0
        sent = {(smp.labels["protocol"], smp.labels["direction"]): smp.value
                for smp in fams["atd_transport_bytes"].samples if smp.name == "atd_transport_bytes_total"}
        # b and c fetched the aggregate's blob from a over the bulk channel (its row is always
        # present, so the count must be > 0: a node without bulk fails here)
        assert sent[("bulk", "sent")] > 0 and sent[("gossip", "sent")] > 0
        assert any(p.startswith("/atd/sync") and v > 0 for (p, _), v in sent.items())
        verified = {smp.labels["status"]: smp.value for smp in fams["atd_aggregates"].samples}
        assert verified.get("verified") == 1

        assert get(url + "healthz")[:3:2] == (200, "ok")
        assert get(url, host="evil.example")[0] == 400  # DNS rebinding: another Host is refused
        assert get(url, method="POST")[0] == 405  # read-only
        assert get(url + "models/..%2f..%2fnode.key/confusion.png")[0] == 404

        # a member that should be reachable goes down: the page says so
        daemons[2].stop()
        c_id = next(m["peer_id"] for m in s["members"] if m["name"] == "c")
        wait_until(lambda: c_id not in json.loads(get(url + "api/state")[2])["node"]["peers"], 60, "c to drop")
        dom = browser("--dump-dom", url)
        assert re.search(r"\b1 of 2 members connected\b", text_of(dom))
        assert 'class="card warn" id="card-peers"' in dom
        row_c = re.search(r'<tr class="peer"><td>c<br>.*?</tr>', dom, re.S).group(0)
        assert "peer-warning" in row_c and "not connected" in text_of(row_c)
        assert len(re.findall(r"peer-warning", dom)) == 1
    finally:
        for d in daemons:
            d.stop()


def test_bulk_and_stream_bytes_are_counted_by_protocol(tmp_path) -> None:
    """A libp2p fetch moves its chunks over the bulk channel: /metrics' "bulk" rows see them."""
    import trio

    from atdnode.blobs import BULK_BYTES
    from tests.blobnet import blob_bytes, cluster

    async def body() -> None:
        async with cluster("libp2p", 2, tmp_path) as (a, b):
            data = blob_bytes()
            h = a.store.put_bytes(data)
            before = list(BULK_BYTES.by_protocol.get("bulk", [0, 0]))
            await b.svc.fetch(h, [a.t.peer_id], manifest_hash=a.store.manifest(h).hash)
            after = BULK_BYTES.by_protocol["bulk"]
            # one process holds both ends: the server's sends and the client's receives
            assert after[0] - before[0] >= len(data) and after[1] - before[1] >= len(data)
            streams = b.t.bytes_by_protocol()
            assert any(p.startswith("/atd/blob") and sent > 0 and recv > 0 for p, (sent, recv) in streams.items())

    trio.run(body)


def test_metrics_text_parses_and_escapes() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from atdnode.report.dashboard import prom

    snap = {"peer_id": "12D3KooWx", "consortium": 'St. "Mary\'s"\nEast\\', "peers": ["p1"],
            "members": {"active": 2, "revoked": 1}, "ledger_states": {"log": 9, "held": 1, "evidence": 0},
            "kinds": {"hello": 3}, "bytes_by_protocol": {"gossip": (10, 20), "bulk": (0, 0)},
            "fetches": [{"blob": "ab" * 32, "bytes": 512, "size": 2048}], "wanted": 1, "blobs": 4,
            "stats": {"gossip_in": 5, "gossip_rejected": 2, "refused_non_member": 1}, "aggregates": {"verified": 1}}
    fams = {f.name: f for f in text_string_to_metric_families(prom.render(prom.node_families(snap)))}
    assert fams["atd_info"].samples[0].labels["consortium"] == snap["consortium"]
    assert fams["atd_fetch_bytes"].samples[0].value == 512 and fams["atd_fetch_size_bytes"].samples[0].value == 2048
    assert {s.labels["reason"] for s in fams["atd_refusals"].samples} == {"gossip_rejected", "refused_non_member"}
    assert fams["atd_transport_bytes"].type == "counter"
    assert {s.labels["state"]: s.value for s in fams["atd_ledger_entries"].samples}["held"] == 1


def test_page_escapes_peer_data_and_shows_fetch_progress() -> None:
    """Entry bodies come from other nodes: nothing they say may become markup."""
    from atdnode.report.dashboard.page import render_page

    evil = '<script>alert(1)</script>'
    state = {
        "node": {"peer_id": "12D3KooWme", "name": "a", "role": "node", "addrs": [], "peers": [], "started": 1.0,
                 "now": 2.0},
        "consortium": evil, "entries": 1, "states": {"log": 1}, "wanted": 0, "split": [], "services": [],
        "members": [{"peer_id": "12D3KooWev", "name": evil, "me": False, "founder": False, "admin": False,
                     "revoked": False, "rotated_to": None, "role": evil, "addrs": [evil], "connected": False}],
        "timeline": [{"id": "ab" * 32, "kind": "hello", "author": evil, "seq": 1, "lamport": 1, "summary": evil,
                      "stored": 1.0, "verified": True}],
        "published": [], "aggregates": [], "models": [],
        "campaigns": [{"algorithm": "pfesta", "state": "running", "round": 3, "total": 4, "completed": 2,
                       "clients": 2, "detail": ""}],
        "fetches": [{"blob": "cd" * 32, "bytes": 256, "size": 1024, "fraction": 0.25, "holders": ["x"], "modes": {}}],
    }
    page = render_page(state)
    assert "<script" not in page and page.count("&lt;script&gt;") >= 5
    assert 'style="width:25%"' in page and "256 B of 1.0 KiB" in page
    assert re.search(r'<tr class="campaign"><td>pfesta</td><td>running</td><td>2 of 4 \(open: 3\)</td><td>2</td>', page)


def test_host_guard_allows_loopback_names_only() -> None:
    import trio

    from atdnode.report.dashboard.server import host_guard

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = host_guard(app, {"127.0.0.1", "localhost", "[::1]"})

    async def status(host: str) -> int:
        sent = []

        async def send(msg):
            sent.append(msg)

        await guarded({"type": "http", "headers": [(b"host", host.encode())]}, None, send)
        return sent[0]["status"]

    async def main():
        ok = ["127.0.0.1:8470", "localhost:1", "LOCALHOST", "[::1]:9000", "127.0.0.1"]
        bad = ["evil.example", "evil.example:8470", "127.0.0.1.evil.example:80", "[::2]:1", ""]
        assert [await status(h) for h in ok] == [200] * len(ok)
        assert [await status(h) for h in bad] == [400] * len(bad)

    trio.run(main)
