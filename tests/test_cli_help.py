"""Every `atd ... --help` prints its help strings as written and documents every option.

The rendered help of every command and group is compared with the help strings in the
source (whitespace-normalised, since click wraps lines): a square bracket eaten by markup
(`'atd[tensorboard]'` -> `'atd'`) or a lost `[logs]` fails here. Every option has a help line,
and every option that has a value when absent shows it (`[default: ...]`); flags render without a value (`--json`, not `--json <bool>`).
"""
from __future__ import annotations

import functools
import re

import typer
from typer.testing import CliRunner

from cli.app import app
from cli.helpfmt import WORKFLOW

runner = CliRunner()


def _norm(text: str) -> str:
    return " ".join(text.split())


def _commands() -> list[tuple[list[str], object]]:
    root = typer.main.get_command(app)
    out, todo = [], [([], root)]
    while todo:
        path, cmd = todo.pop()
        out.append((path, cmd))
        if hasattr(cmd, "commands"):  # a group (typer bundles its own click: no isinstance)
            todo.extend(([*path, n], c) for n, c in cmd.commands.items())
    return out


COMMANDS = _commands()


def _help(path: list[str]) -> str:
    return _rendered(tuple(path))


@functools.lru_cache(maxsize=None)
def _rendered(path: tuple[str, ...]) -> str:
    r = runner.invoke(app, [*path, "--help"], terminal_width=4000, max_content_width=4000)  # no wrapping
    assert r.exit_code == 0, (path, r.output)
    return r.stdout


def _source_texts(cmd) -> list[str]:
    first = (cmd.help or "").split("\f")[0]
    texts = [p for p in first.split("\n\n") if p.strip()]
    texts += [p.help for p in cmd.params if getattr(p, "help", None)]
    return texts


def test_every_help_text_survives_as_written():
    assert len(COMMANDS) > 40
    lost = []
    for path, cmd in COMMANDS:
        shown = _norm(_help(path))
        for text in _source_texts(cmd):
            want = _norm(text.replace("\b", ""))
            if want not in shown:
                lost.append((" ".join(path), want[:80]))
    assert not lost, lost


def test_brackets_from_the_source_are_printed():
    # bracketed names from the source, checked by name: markup used to eat all three
    shown = _norm(_help(["train"])) + _norm(_help(["node", "start"])) + _norm(_help(["models", "prune"]))
    for token in ("'atd[tensorboard]'", "'atd[mlflow]'", "[logs] max_bytes", "[models] max_bytes"):
        assert token in shown, token


def _row(shown: str, opt: str) -> str:
    """The option's own row of the help (rendered unwrapped; an option whose name and choices
    fill the first column has its help on the next, deeper-indented line)."""
    m = re.search(r"^ +(?:-\w, )?" + re.escape(opt) + r"\b.*(?:\n {3,}\S.*)*", shown, re.M)
    assert m, (opt, shown)
    return m.group(0)


def test_every_option_has_help_and_shows_its_default():
    bad = []
    for path, cmd in COMMANDS:
        shown = _help(path)
        for p in cmd.params:
            if p.param_type_name != "option" or p.name == "help":
                continue
            name = max(p.opts, key=len)
            row = _row(shown, name)
            if not (p.help or "").strip():
                bad.append((" ".join(path), name, "no help"))
            # a value that applies when the option is absent is printed: [default: ...]
            unset = p.default is None or p.default == () or p.default == [] or p.is_flag or p.required
            if not unset and "default:" not in row.lower():
                bad.append((" ".join(path), name, "default not shown"))
            if p.is_flag and re.search(re.escape(name) + r"\s+<", row):
                bad.append((" ".join(path), name, "flag shown with a value"))
    assert not bad, "\n".join(map(str, bad))


def _choice_options() -> dict[tuple[tuple[str, ...], str], tuple[str, ...]]:
    """Every option whose value is one of a fixed set, with the set as its registry names it."""
    from atdnode.data import ALL, SPLITS
    from atdnode.models import PARTS
    from atdnode.split import ACCEPT_POLICIES, EMBEDDER_HEADS, METHODS
    from netsim.scenario_choices import Backend, Method
    from protocols.weightings import CLASSIFIERS, MODES, PRIORS, ROUND_AGGREGATORS, weightings

    return {(("aggregate",), "--mode"): tuple(MODES),
            (("aggregate",), "--weighting"): tuple(dict.fromkeys(weightings("average") + weightings("group"))),
            (("aggregate",), "--group-weighting"): weightings("average"),
            (("aggregate",), "--classifier"): tuple(CLASSIFIERS), (("aggregate",), "--prior"): tuple(PRIORS),
            (("rounds",), "--weighting"): weightings("round"), (("rounds",), "--aggregator"): tuple(ROUND_AGGREGATORS),
            (("publish-weights",), "--part"): PARTS, (("classify",), "--split"): ("auto", ALL, *reversed(SPLITS)),
            (("demo",), "--backend"): tuple(Backend), (("netsim", "run"), "--backend"): tuple(Backend),
            (("netsim", "run"), "--method"): tuple(Method),
            (("split", "configure"), "--head"): EMBEDDER_HEADS, (("split", "configure"), "--accept"): ACCEPT_POLICIES,
            (("split", "compare"), "--method"): METHODS}


def test_every_choice_option_lists_the_choices_of_its_registry():
    missing = []
    for (path, opt), names in _choice_options().items():
        row = _row(_help(list(path)), opt)
        if "|".join(names) not in row:
            missing.append((" ".join(path), opt, names, row.strip()[:120]))
    assert not missing, "\n".join(map(str, missing))


def test_split_configure_shows_what_each_setting_falls_back_to():
    shown = _help(["split", "configure"])
    for opt in ("--img-size", "--rounds", "--batch-size", "--seed"):
        assert "[default:" in _row(shown, opt), opt


def test_top_level_help_lists_commands_in_workflow_sections():
    shown = _help([])
    for title, _ in WORKFLOW:
        assert f"{title}:" in shown, title
    order = [shown.index(f"\n  {n} ") for n in ("init", "node", "train", "aggregate", "ledger")]
    assert order == sorted(order)
    root = typer.main.get_command(app)
    listed = {line.split()[0] for line in shown.splitlines() if line.startswith("  ") and not line.startswith("   ")}
    assert set(root.commands) <= listed  # a command no section names still shows (under "Other")


def test_models_help_promises_only_what_exists():
    shown = _help(["models"])
    root = typer.main.get_command(app)
    subs = set(root.commands["models"].commands)
    for word in re.findall(r"`atd models (\w+)", shown):
        assert word in subs, word
    r = runner.invoke(app, ["models", "list", "--help"])
    assert r.exit_code == 0, r.output


def test_version() -> None:
    from importlib.metadata import version

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith(f"atd {version('atd')} (Python 3."), r.output
    assert r.stdout.count("\n") == 1
