"""`atd init / id / member / ledger ...`: the consortium commands end to end and one-line errors."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from cli.app import main

ACCEPTANCE = r"""
set -euo pipefail
atd init --home /tmp/a --genesis --consortium demo
atd init --home /tmp/b --join "$(atd ledger show --home /tmp/a --kind genesis --json | python -c 'import json,sys; print(json.load(sys.stdin)[0]["id"])')"
atd member add --home /tmp/a "$(atd id --home /tmp/b)"
atd ledger verify --home /tmp/a
atd ledger export --home /tmp/a /tmp/a.dump && atd ledger import --home /tmp/b /tmp/a.dump && atd ledger verify --home /tmp/b
"""


def atd(capsys, *args: str) -> tuple[int, str, str]:
    """Run the real console entry point in-process: (exit code, stdout, stderr)."""
    old = sys.argv
    sys.argv = ["atd", *args]
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow  # atd as OS processes
def test_acceptance_commands_as_written(tmp_path):
    script = ACCEPTANCE.replace("/tmp/", f"{tmp_path}/")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("note: ")]  # verify's --peers hint
    assert lines[0].startswith("12D3KooW") and lines[1].startswith("12D3KooW")
    assert lines[2].startswith(f"admitted {lines[1]}")
    assert lines[3].startswith("ok: 2 entries")
    assert "2 added to the log" in lines[5] and lines[6].startswith("ok: 2 entries")


@pytest.fixture
def pair(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    code, pa, _ = atd(capsys, "init", "--home", a, "--genesis", "--consortium", "demo", "--name", "alpha")
    assert code == 0
    _, gj, _ = atd(capsys, "ledger", "show", "--home", a, "--kind", "genesis", "--json")
    code, pb, _ = atd(capsys, "init", "--home", b, "--join", json.loads(gj)[0]["id"])
    assert code == 0
    return a, b, pa.strip(), pb.strip()


def test_id_and_show(pair, capsys):
    a, b, pa, pb = pair
    assert atd(capsys, "id", "--home", a)[1].strip() == pa
    code, out, _ = atd(capsys, "id", "--home", b, "--json")
    assert code == 0 and json.loads(out)["peer_id"] == pb
    assert atd(capsys, "member", "add", "--home", a, pb, "--name", "bee")[0] == 0
    code, out, _ = atd(capsys, "ledger", "show", "--home", a, "--json")
    entries = json.loads(out)
    assert [e["kind"] for e in entries] == ["genesis", "member"]
    assert entries[1]["author"] == pa and entries[1]["seq"] == 2 and len(entries[1]["id"]) == 64
    assert entries[0]["body"]["consortium"] == "demo"
    code, out, _ = atd(capsys, "ledger", "show", "--home", a, "--author", pb, "--json")
    assert json.loads(out) == []
    code, out, _ = atd(capsys, "ledger", "show", "--home", a)
    assert code == 0 and "genesis" in out and "member" in out
    code, out, _ = atd(capsys, "member", "list", "--home", a, "--json")
    members = {m["peer_id"]: m for m in json.loads(out)["members"]}
    assert members[pa]["founder"] and members[pb]["name"] == "bee"


def test_member_revoke_and_admin_rules(pair, capsys):
    a, b, pa, pb = pair
    code, _, err = atd(capsys, "member", "add", "--home", b, pa)
    assert code != 0 and err.count("\n") == 1 and "only an admin" in err and "Traceback" not in err
    assert atd(capsys, "member", "add", "--home", a, pb)[0] == 0
    code, out, _ = atd(capsys, "member", "revoke", "--home", a, pb)
    assert code == 0 and "revoked" in out
    code, _, err = atd(capsys, "member", "add", "--home", a, pb)
    assert code != 0 and "revocation is permanent" in err
    code, _, err = atd(capsys, "member", "add", "--home", a, "not-a-peer-id")
    assert code != 0 and "peer id" in err


def test_init_errors_are_one_line(tmp_path, capsys, pair):
    a, *_ = pair
    for args, match in (
        (["init", "--home", a], "already holds"),
        (["init", "--home", str(tmp_path / "c"), "--genesis"], "--consortium"),
        (["init", "--home", str(tmp_path / "d"), "--join", "xyz"], "64-hex"),
        (["id", "--home", str(tmp_path / "nothing")], "no atd node"),
    ):
        code, _, err = atd(capsys, *args)
        assert code != 0 and match in err and err.count("\n") == 1, err


def test_verify_names_the_first_bad_entry(pair, capsys):
    a, b, pa, pb = pair
    atd(capsys, "member", "add", "--home", a, pb)
    db = Path(a) / "ledger.db"
    conn = sqlite3.connect(db)
    (sig,) = conn.execute("SELECT sig FROM entries WHERE pos=2").fetchone()
    (eid,) = conn.execute("SELECT id FROM entries WHERE pos=2").fetchone()
    conn.execute("UPDATE entries SET sig=? WHERE pos=2", (bytes([sig[0] ^ 1]) + sig[1:],))
    conn.commit()
    conn.close()
    code, out, err = atd(capsys, "ledger", "verify", "--home", a)
    assert code != 0 and err.count("\n") == 1
    assert pa in err and "seq 2" in err and eid.hex() in err


def test_export_import_counts_and_bad_dump(pair, capsys, tmp_path):
    a, b, pa, pb = pair
    dump = str(tmp_path / "a.dump")
    assert atd(capsys, "ledger", "export", "--home", a, dump)[0] == 0
    code, out, _ = atd(capsys, "ledger", "import", "--home", b, dump)
    assert code == 0 and "1 added to the log" in out
    code, out, _ = atd(capsys, "ledger", "import", "--home", b, dump)
    assert code == 0 and "1 already present" in out
    Path(dump).write_bytes(b"junk")
    code, _, err = atd(capsys, "ledger", "import", "--home", b, dump)
    assert code != 0 and "dump" in err


def test_missing_ledger_is_an_error_not_a_fresh_ledger(pair, capsys):
    a, *_ = pair
    for suffix in ("", "-wal", "-shm"):
        p = Path(a) / f"ledger.db{suffix}"
        if p.exists():
            p.unlink()
    code, _, err = atd(capsys, "ledger", "verify", "--home", a)
    assert code != 0 and "missing" in err
    assert not (Path(a) / "ledger.db").exists()
