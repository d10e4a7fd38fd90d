"""config.toml for people who never open it: `atd init` lists every section with its
defaults commented; `atd config set KEY VALUE` writes one setting after the reading part's
own validation accepts it, and a refused value leaves the file as it was."""
from __future__ import annotations

import dataclasses

import tomllib

from typer.testing import CliRunner

from atdnode.node import KEYS, NodeConfig, NodeHome
from atdnode.node.logs import log_limits
from atdnode.peers import PeerSetConfig
from cli.app import app

runner = CliRunner()


def ok(*args: str) -> str:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, (r.output, r.exception)
    return r.stdout


def refused(*args: str) -> str:
    r = runner.invoke(app, list(args))
    assert r.exit_code != 0 and r.exception is not None, r.output
    return str(r.exception)


def test_init_lists_every_section_with_defaults_commented(tmp_path):
    home = tmp_path / "n"
    ok("init", "--home", str(home))
    text = (home / "config.toml").read_text()
    for section in ("network", "aggregate", "logs", "peers", "bulk", "models", "compute", "split"):
        assert f"# [{section}]" in text, section
    for k in KEYS:  # table keys commented; top-level ones are written with their values
        assert f"# {k.path.rpartition('.')[2]} = " in text if "." in k.path else f"\n{k.path} = " in "\n" + text, k.path
    data = tomllib.loads(text)  # the comments change nothing
    assert set(data) <= {"name", "listen", "bootstrap", "role", "genesis_id", "consortium"}
    # the commented defaults are the values the readers use when the key is absent
    h = NodeHome.at(home)
    assert f"# max_bytes = {log_limits(h)[0]}" in text and f"# target = {PeerSetConfig().target}" in text


def test_schema_defaults_are_the_readers_defaults(tmp_path):
    """The commented defaults are what each reader uses when the key is absent."""
    from atdnode.node.config_schema import BY_PATH
    from atdnode.aggregation import keep_policy
    from atdnode.models import size_limit
    from atdnode.plans import PlanPolicy
    from atdnode.report import card_statement
    from ledger import AuthorQuota

    ok("init", "--home", str(tmp_path / "n"))
    h = NodeHome.at(tmp_path / "n")
    cfg, peers = NodeConfig.load(h), PeerSetConfig()
    got = {"logs.max_bytes": log_limits(h)[0], "logs.backups": log_limits(h)[1], "models.max_bytes": size_limit(h),
           "bulk.enabled": cfg.bulk_options()["bulk"], "bulk.port": cfg.bulk_options()["bulk_port"],
           "listen": NodeConfig().listen, "network.announce": cfg.announce(), "aggregate.keep": keep_policy(h),
           "bootstrap": NodeConfig().bootstrap, "role": NodeConfig().role,
           "plans.auto_accept_from": list(PlanPolicy.load(h).auto_accept_from), "plans.daemon": PlanPolicy.load(h).daemon,
           **{f"peers.{f.name}": getattr(peers, f.name) for f in dataclasses.fields(peers)},  # every [peers] key
           **{f"card.{k}": v for k, v in card_statement(h).items()},  # every [card] key
           "quota.author_entries": AuthorQuota().author_entries, "quota.author_bytes": AuthorQuota().author_bytes}
    assert log_limits(h) == (10 << 20, 5)  # the documented defaults (README: operations)
    assert {p: BY_PATH[p].default for p in got} == got
    assert set(BY_PATH) - set(got) == {"name", "compute.device", "plans.kinds"}  # none has a fixed value
    assert cfg.compute_device() is None  # absent: cuda when present (atdnode.learning.device)


def test_config_set_writes_validated_values(tmp_path):
    home = tmp_path / "n"
    ok("init", "--home", str(home))
    h = NodeHome.at(home)
    ok("config", "set", "listen", "/ip4/0.0.0.0/tcp/4001", "--home", str(home))
    ok("config", "set", "logs.backups", "3", "--home", str(home))
    ok("config", "set", "bulk.enabled", "false", "--home", str(home))
    ok("config", "set", "compute.device", "cpu", "--home", str(home))
    cfg = NodeConfig.load(h)
    assert cfg.listen == ["/ip4/0.0.0.0/tcp/4001"] and log_limits(h)[1] == 3
    assert cfg.bulk_options()["bulk"] is False and cfg.compute_device() == "cpu"
    text = (home / "config.toml").read_text()
    assert "# [peers]" in text and "# backups = " not in text  # set keys leave the reference block
    shown = ok("config", "show", "--home", str(home))
    assert "logs.backups = 3    # rotated log files kept (an integer from 0 to 100)\n" in shown
    before = (home / "config.toml").read_bytes()
    for args, why in ((["logs.backups", "abc"], "not an integer"),
                      (["logs.backups", "500"], "logs.backups"),
                      (["peers.max", "1"], "peers.max"),
                      (["listen", "not-an-address"], "listen"),
                      (["compute.device", "gpu"], "expected"),
                      (["log.backups", "3"], "did you mean logs.backups"),
                      (["peers.target", "-3"], "peers.target must be an integer >= 1"),  # a value, not a flag
                      (["logs.backups", "-1"], "logs.backups"),
                      (["split.rounds", "3"], "atd split configure"),
                      (["aggregate.keep", "worst"], "aggregate.keep must be one of best, consortium"),
                      (["network.announce", "/ip4/0.0.0.0/tcp/4001"], "unspecified"),
                      (["plans.kinds", "train,dance"], "plans.kinds"),
                      (["card.limitations", "see /data/site/xrays/"], "card.limitations names a file path")):
        assert why in refused("config", "set", *args, "--home", str(home)), args
        assert (home / "config.toml").read_bytes() == before, args  # nothing changed


def test_the_settings_section_of_interfaces_md_is_current():
    from pathlib import Path

    from atdnode.node.config_schema import update_doc

    doc = Path(__file__).resolve().parent.parent / "INTERFACES.md"
    assert update_doc(doc.read_text()) == doc.read_text(), "run: python -m atdnode.node.config_schema INTERFACES.md"


def test_a_hand_edited_value_is_refused_when_the_config_loads_naming_the_key(tmp_path):
    """The declaration is checked as config.toml loads (the daemon, every command), not only by
    `atd config set`: one line naming the key and what it must be; the file stays as it was."""
    import pytest

    from atdnode.errors import ConfigError

    home = tmp_path / "n"
    ok("init", "--home", str(home))
    h = NodeHome.at(home)
    base = (home / "config.toml").read_text()
    for table, line, why in (("logs", "backups = 500", "logs.backups must be an integer from 0 to 100"),
                             ("logs", "max_bytes = 10", "logs.max_bytes must be an integer >= 1024"),
                             ("bulk", "port = -1", "bulk.port must be an integer from 0 to 65535"),
                             ("bulk", 'enabled = "yes"', "bulk.enabled must be true or false"),
                             ("peers", "low_latency_share = 2.5", "peers.low_latency_share must be a number from 0 to 1"),
                             ("models", "max_bytes = -5", "models.max_bytes must be an integer >= 0"),
                             ("compute", "device = 3", "compute.device must be a non-empty string"),
                             ("aggregate", 'keep = "worst"', "aggregate.keep must be one of best, consortium"),
                             ("card", "limitations = 3", "card.limitations must be text"),
                             ("plans", 'kinds = "train"', "plans.kinds must be a list of strings")):
        (home / "config.toml").write_text(f"{base}\n[{table}]\n{line}\n")
        with pytest.raises(ConfigError) as e:
            NodeConfig.load(h)
        assert why in str(e.value) and "\n" not in str(e.value), (line, str(e.value))
        assert (home / "config.toml").read_text() == f"{base}\n[{table}]\n{line}\n"  # nothing rewritten
    (home / "config.toml").write_text(f"{base}\n[logs]\nbackups = 0\n[peers]\ngrace_s = 0\n")  # the bounds themselves
    assert NodeConfig.load(h).setting("logs.backups") == 0 and NodeConfig.load(h).setting("peers.grace_s") == 0


def test_every_declared_setting_can_be_set(tmp_path):
    """`atd config set` writes each key of the declaration (and reads it back through
    `NodeConfig.setting`): no documented setting is left to an editor."""
    from atdnode.node import KEYS

    home = tmp_path / "n"
    ok("init", "--home", str(home))
    values = {"name": ("n2", "n2"), "role": ("node", "node"), "compute.device": ("cpu", "cpu"),
              "bulk.enabled": ("false", False),
              "listen": ("/ip4/127.0.0.1/tcp/4002", ["/ip4/127.0.0.1/tcp/4002"]), "bootstrap": ("[]", []),
              "peers.max": ("20", 20), "peers.target": ("3", 3), "peers.low_latency_share": ("0.25", 0.25),
              "network.announce": ("/ip4/127.0.0.1/tcp/4003", ["/ip4/127.0.0.1/tcp/4003"]),
              "aggregate.keep": ("consortium", "consortium"), "plans.auto_accept_from": ("node1", ["node1"]),
              "plans.kinds": ("train,publish", ["train", "publish"]), "plans.daemon": ("false", False),
              **{f"card.{f}": ("chest X-rays, adults", "chest X-rays, adults") for f in
                 ("intended_use", "out_of_scope_use", "data_description", "limitations")}}
    for k in KEYS:  # any other key: one more than its default (every other key is a number)
        text, want = values.get(k.path) or (str(k.default + 1), k.default + 1)
        ok("config", "set", k.path, text, "--home", str(home))
        assert NodeConfig.load(NodeHome.at(home)).setting(k.path) == want, k.path


def test_config_set_takes_negative_numbers_and_the_keep_policy(tmp_path):
    home = tmp_path / "n"
    ok("init", "--home", str(home))
    assert ok("config", "set", "logs.max_bytes", "2048", "--home", str(home)).strip() == "logs.max_bytes = 2048"
    assert ok("config", "set", "aggregate.keep", "consortium", "--home", str(home)).strip() == 'aggregate.keep = "consortium"'
    from atdnode.aggregation import keep_policy

    assert keep_policy(NodeHome.at(home)) == "consortium"
    r = runner.invoke(app, ["config", "set", "peers.grace_s", "-1", "--home", str(home)])
    assert r.exit_code != 0 and "No such option" not in r.output and "peers.grace_s" in str(r.exception)
