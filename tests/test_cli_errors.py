"""Every `atd` command, given bad input, prints ONE line on stderr and exits non-zero.

The commands are enumerated from the typer app itself (groups and subcommands), so a
command added later is covered without touching this file. Each one is run with: a bogus
option; no arguments (when it requires some); a home that is not a node (a regular file),
given as --home and as ATD_HOME; and a junk file for the required arguments of commands
without a home. Most runs are in-process (`cli.app.run`, the console script's body); the
usage errors also run as real `python -m cli.app` processes, as users run them.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import typer

from cli.app import app, run
from cli.options import HOME_ENV

ROOT = Path(__file__).resolve().parents[1]


def _params(fn) -> list[tuple[str, object, object]]:
    """(name, OptionInfo/ArgumentInfo, annotation) of a command callback."""
    hints = typing.get_type_hints(fn)
    return [(name, p.default, hints.get(name)) for name, p in inspect.signature(fn).parameters.items()
            if isinstance(p.default, (typer.models.OptionInfo, typer.models.ArgumentInfo))]


def _name(info, fn) -> str:
    name = info.name if isinstance(info.name, str) else None
    return name or fn.__name__.replace("_", "-")


def leaf_commands(t: typer.Typer = app, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """Every runnable command of the app as (argv path, callback), groups recursed; a group
    whose callback runs without a subcommand (`atd models`) counts as a command too."""
    out = [((*path, _name(c, c.callback)), c.callback) for c in t.registered_commands]
    cb = t.registered_callback
    if path and cb is not None and cb.callback is not None and (
            cb.invoke_without_command or t.info.invoke_without_command):
        out.append((path, cb.callback))
    for g in t.registered_groups:
        out += leaf_commands(g.typer_instance, (*path, g.name or g.typer_instance.info.name))
    return out


COMMANDS = leaf_commands()
IDS = [" ".join(p) for p, _ in COMMANDS]


def _is_home(info) -> bool:
    return isinstance(info, typer.models.OptionInfo) and "--home" in (info.param_decls or ())


def _required(info) -> bool:
    return info.default is ... or info.default is Ellipsis


def _filler(info, ann, junk: Path) -> list[str]:
    """argv for one required parameter: a value of the right type that means nothing."""
    base = typing.get_args(ann)[0] if typing.get_origin(ann) in (list, typing.Union) else ann
    value = "1" if base in (int, float) else str(junk)
    if isinstance(info, typer.models.ArgumentInfo):
        return [value]
    return [info.param_decls[0], value]


def _argv(path, fn, junk: Path, home: str | None) -> list[str]:
    argv = list(path)
    for _, info, ann in _params(fn):
        if _is_home(info):
            if home is not None:
                argv += ["--home", home]
        elif _required(info):
            argv += _filler(info, ann, junk)
    return argv


@pytest.fixture
def junk(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv(HOME_ENV, raising=False)
    p = tmp_path / "junk.toml"
    p.write_bytes(b"\x00\xffnot a node, a dump, a scenario or an image [[[\n")
    return p


def one_line_failure(capsys, argv: list[str]) -> str:
    code = run(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, (argv, out, err)
    assert code != 0, (argv, out, err)
    assert err.count("\n") == 1 and err.startswith("error: "), (argv, err)
    return err


def test_the_enumeration_finds_every_command():
    names = set(IDS)
    assert {"init", "train", "node start", "ledger verify", "ledger import", "fetch", "split join",
            "netsim run", "member revoke", "aggregate"} <= names, names
    assert len(names) == len(COMMANDS)


@pytest.mark.parametrize("path,fn", COMMANDS, ids=IDS)
def test_every_command_fails_in_one_line(path, fn, junk, capsys, monkeypatch):
    err = one_line_failure(capsys, [*path, "--no-such-option"])
    assert "--no-such-option" in err
    params = _params(fn)
    if any(_required(info) for _, info, _ in params):
        one_line_failure(capsys, list(path))
    if any(_is_home(info) for _, info, _ in params):
        home_info = next(info for _, info, _ in params if _is_home(info))
        assert home_info.envvar == HOME_ENV, f"{' '.join(path)}: use cli.options.HOME_OPT (reads ATD_HOME)"
        for_home = one_line_failure(capsys, _argv(path, fn, junk, str(junk)))
        monkeypatch.setenv(HOME_ENV, str(junk))  # the same failure, with the home from the environment
        assert one_line_failure(capsys, _argv(path, fn, junk, None)) == for_home
        monkeypatch.delenv(HOME_ENV)
    elif any(_required(info) for _, info, _ in params):
        one_line_failure(capsys, _argv(path, fn, junk, None))


def _choices(ann) -> tuple[str, ...] | None:
    """The names an option annotated `ann` (an enumeration, maybe Optional or a list) accepts."""
    import enum

    while typing.get_origin(ann) in (list, typing.Union):
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    return tuple(m.value for m in ann) if isinstance(ann, type) and issubclass(ann, enum.Enum) else None


CHOICE_OPTIONS = [(path, (info.param_decls or ("--" + name.replace("_", "-"),))[0], names)
                  for path, fn in COMMANDS for name, info, ann in _params(fn)
                  if isinstance(info, typer.models.OptionInfo) and (names := _choices(ann))]


def test_the_choice_options_are_enumerations():
    found = {(" ".join(path), opt) for path, opt, _ in CHOICE_OPTIONS}
    assert {("aggregate", "--mode"), ("aggregate", "--weighting"), ("aggregate", "--group-weighting"),
            ("aggregate", "--classifier"), ("aggregate", "--prior"), ("rounds", "--weighting"),
            ("rounds", "--aggregator"), ("publish-weights", "--part"), ("classify", "--split"),
            ("demo", "--backend"), ("netsim run", "--backend"), ("netsim run", "--method"),
            ("split configure", "--head"), ("split configure", "--accept"), ("split compare", "--method")} <= found, found


@pytest.mark.parametrize("path,opt,names", CHOICE_OPTIONS, ids=[f"{' '.join(p)} {o}" for p, o, _ in CHOICE_OPTIONS])
def test_a_value_outside_a_choice_is_a_one_line_usage_error(path, opt, names, junk, capsys):
    # refused before any other parameter is looked at: no home, no required argument needed
    err = one_line_failure(capsys, [*path, opt, "no-such-choice"])
    assert f"'{opt}'" in err and "'no-such-choice'" in err and "Value error" not in err, err
    assert all(f"'{n}'" in err for n in names), (names, err)


def test_dependent_choices_keep_their_one_line_cross_check(junk, capsys):
    from atdnode.aggregation import AggregateError, check_arguments

    err = one_line_failure(capsys, ["rounds", "--home", str(junk), "--rounds", "1", "--weighting", "fedavg",
                                    "--aggregator", "median"])
    assert "--weighting fedavg and --aggregator median: give one" in err, err
    with pytest.raises(AggregateError, match="--weighting uniform does not apply to --mode hierarchical: "
                                             "choose from sqrt-classes, model-count"):
        check_arguments("hierarchical", weighting="uniform")
    check_arguments("hierarchical", weighting="model-count")  # applies: no error


def test_group_without_a_subcommand_shows_help_not_a_traceback(capsys):
    run(["ledger"])  # exit code: 2 from click >= 8.2, 0 before
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "verify" in out + err


ISSUE_USAGE_ERRORS = [
    (["bogus"], "No such command"),
    (["train"], "Missing option '--home'"),
    (["peers", "--json"], "No such option"),
    (["ledger", "verify", "--json"], "No such option"),
    (["fetch", "--bogus"], "No such option"),
]


@pytest.mark.slow  # atd as OS processes
def test_usage_errors_as_real_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != HOME_ENV}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cases = [*ISSUE_USAGE_ERRORS, (["id"], "ATD_HOME"),
             (["node", "start", "--home", str(tmp_path), "--listen", "bogus"], "no atd node")]
    procs = [subprocess.Popen([sys.executable, "-m", "cli.app", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) for argv, _ in cases]
    for (argv, want), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode not in (0, None) and "Traceback" not in out + err, (argv, out, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and want in err, (argv, err)


def test_atd_home_is_read_when_home_is_absent(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(HOME_ENV, raising=False)
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(HOME_ENV, str(a))
    assert run(["init", "--genesis", "--consortium", "c"]) == 0  # made at $ATD_HOME
    pa = capsys.readouterr().out.strip()
    assert run(["init", "--home", str(b)]) == 0
    pb = capsys.readouterr().out.strip()
    assert run(["id"]) == 0 and capsys.readouterr().out.strip() == pa
    assert run(["id", "--home", str(b)]) == 0 and capsys.readouterr().out.strip() == pb  # --home wins
    assert run(["member", "list", "--json"]) == 0 and pa in capsys.readouterr().out


def test_unexpected_errors_are_one_line_too(capsys, monkeypatch):
    """A bug (here: a command that raises a TypeError) is one line; ATD_DEBUG=1 shows the traceback."""
    import cli.commands.ident as ident_mod

    def broken(*_a, **_k):
        raise TypeError("an unforeseen bug")

    monkeypatch.setattr(ident_mod, "node_home", broken)
    err = one_line_failure(capsys, ["id", "--home", "/nowhere"])
    assert "TypeError: an unforeseen bug" in err and "ATD_DEBUG" in err
    monkeypatch.setenv("ATD_DEBUG", "1")
    assert run(["id", "--home", "/nowhere"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_errors_inside_exception_groups_are_unwrapped(capsys):
    from atdnode.errors import DaemonError
    from cli.failure import report

    import trio

    async def fails() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(trio.sleep_forever)
            raise DaemonError("a daemon already runs for /x")

    with pytest.raises(BaseExceptionGroup) as info:
        trio.run(fails, strict_exception_groups=True)
    assert report(info.value) == 1
    assert capsys.readouterr().err == "error: a daemon already runs for /x\n"


@pytest.fixture
def node(tmp_path, capsys, monkeypatch) -> Path:
    monkeypatch.delenv(HOME_ENV, raising=False)
    home = tmp_path / "n"
    assert run(["init", "--home", str(home), "--genesis", "--consortium", "c"]) == 0
    capsys.readouterr()
    return home


def test_malformed_files_in_a_real_home(node, junk, capsys):
    h = str(node)
    assert "not an atd ledger dump" in one_line_failure(capsys, ["ledger", "import", str(junk), "--home", h])
    one_line_failure(capsys, ["train", "--home", h, "--data", f"npz:{junk}"])
    # train reports what it loaded on stderr before it reads the checkpoint: the error is still one line, last
    # (a tiny model on 40 digits: the default ViT at 224 px cost ~6 s of CPU to resize and build)
    assert run(["train", "--home", h, "--init-from", str(junk), "--data", "digits?limit=40", "--img-size", "16",
                "--patch-size", "4", "--embed-dim", "32", "--depth", "1", "--heads", "2"]) != 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert "Traceback" not in out + err and lines[-1].startswith("error: ") and err.count("error:") == 1, err
    one_line_failure(capsys, ["ledger", "export", str(junk / "cannot" / "be"), "--home", h])
    cfg = (node / "config.toml").read_bytes()
    (node / "config.toml").write_bytes(junk.read_bytes())
    assert "config.toml" in one_line_failure(capsys, ["node", "start", "--home", h])
    (node / "config.toml").write_bytes(cfg + b'listen = "not a list"\n')
    one_line_failure(capsys, ["node", "start", "--home", h])
    (node / "config.toml").write_bytes(cfg)
    (node / "ledger.db").write_bytes(junk.read_bytes() * 1000)
    assert "unexpected" not in one_line_failure(capsys, ["ledger", "verify", "--home", h])
    (node / "node.key").write_bytes(b"short")
    one_line_failure(capsys, ["id", "--home", h])


def test_ledger_import_exits_non_zero_when_entries_are_rejected(node, tmp_path, capsys):
    """The good entries are imported and counted; the bad ones make the exit code 1."""
    from ledger.encoding import pack, unpack

    b = tmp_path / "b"
    with __import__("ledger").Ledger.open(node / "ledger.db") as led:
        genesis = led.query(kind="genesis")[0].id.hex()
    assert run(["init", "--home", str(b), "--join", genesis]) == 0
    pb = capsys.readouterr().out.strip()
    assert run(["member", "add", "--home", str(node), pb]) == 0
    dump = tmp_path / "a.dump"
    assert run(["ledger", "export", str(dump), "--home", str(node)]) == 0
    obj = unpack(dump.read_bytes())
    obj["entries"].append(b"\x92\xc4\x03bad\xc4\x01x")  # undecodable: rejected
    obj["count"] += 1
    dump.write_bytes(pack(obj))
    capsys.readouterr()
    assert run(["ledger", "import", str(dump), "--home", str(b)]) == 1
    out, err = capsys.readouterr()
    assert "2 added to the log" in out and "1 rejected" in out
    assert err.count("\n") == 1 and err.startswith("error: 1 entries of") and "Traceback" not in out + err
    assert run(["ledger", "verify", "--home", str(b)]) == 0 and "ok: 2 entries" in capsys.readouterr().out
