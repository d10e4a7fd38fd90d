"""Shared fixtures. Start here when writing a test.

Factories (plain functions, importable from their modules; never import another test module:
`tests/test_suite_shape.py` checks):
- `tests/factories.py`: `make_consortium(root, n)` (N homes, n0 founds and admits the rest),
  `daemon_on(net, home)` (a real `NodeDaemon` on the in-memory network), `append`, `ids`, `cli`,
  `cli_json`, `transports(kind, n)` (bare transports, both kinds), `run`, and
  `wait_for(cond, what, timeout)`: the one way to wait inside a trio run.
- `tests/nodeprocs.py`: daemons as OS processes (the library's `DaemonProcess`; `start_daemon`
  returns once the daemon announced itself), `atd(...)` as a subprocess, `status(home)`, and
  `wait_until(cond, timeout, what)`: the one way to wait outside trio.
- `tests/vgs_homes.py`: homes with trained tiny ViTs (the `disjoint` and `skewed` trios).
- `tests/atd_forkserver.py`: `forkserver(root, env)`, `atd` commands each forked from one
  interpreter that imported torch, timm, scikit-learn and matplotlib once (the README
  walkthroughs run their ~20 torch commands through it).
- `tests/blobnet.py`, `tests/splitnet.py`, `tests/split_checks.py`, `tests/browser.py`,
  `tests/medimg.py`, `tests/mdblocks.py`, `tests/netsim_tiny.py`: narrower helpers.

Fixtures here: `short_tmp` (a short folder: AF_UNIX socket paths under it fit), `consortium` (N
fresh homes under tmp_path), `vgs_template` (the trained trios, built once
per run, shared by xdist workers) and `vgs_trio` (a private copy of one for a test to change).

Tiers: `pytest -m "not slow"` is the fast tier (every change); `pytest` runs everything.
Mark a test `slow` when it starts OS processes or trains for more than a few seconds. The
`claims` tier (3-seed accuracy claims, ~20 minutes on 2 cores) runs only with
`pytest --claims tests/test_vgs_claims_public.py`; the paper's claims on the synthetic
`three_phase` scenario (tests/test_vgs_claims.py) and a few expensive repeats of a claim that
a cheaper default test covers are in it too (`pytest --claims -m claims`).

Order (`pytest_collection_modifyitems`): the files in `LONGEST_FIRST` first, then the other
files with a slow test, then the rest; in the fast tier (no slow test selected) the files in
`FAST_LONGEST_FIRST` first, then the rest. With `-n 3 --dist loadfile --no-loadscope-reorder`
xdist hands files to its workers in this order, so the longest start at once and short files
fill the end, instead of a 3-minute file starting last and running alone.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

# One compute thread per process, for the test process and every daemon / CLI process it
# starts (they inherit the environment): `-n 2` runs one worker per core, and a second torch /
# BLAS thread per worker only spins against the other worker (a tiny ViT trains no faster on
# two threads; under load a 2-epoch netsim training took 40 s on two threads, 2.9 s on one).
# Set before anything imports numpy or torch; a test that wants more threads sets its own.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# Outside a terminal `atd aggregate` / `atd classify` print plain progress lines on stderr
# (cli.progress); the tests read stderr as each command's own lines (one line per error), so
# they run without them, and a test of the lines sets ATD_PROGRESS itself.
os.environ.setdefault("ATD_PROGRESS", "0")
# Cache bytecode even where PYTHONDONTWRITEBYTECODE is set (it is on the shared machine): with
# it, every xdist worker re-ran pytest's assertion rewrite of every test module at each
# collection (~260 rewrites, 3-5 s CPU per worker), and every daemon / CLI process the tests
# start compiled the project again. The caches are `__pycache__/` folders (.gitignore).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
from pathlib import Path
from typing import Callable, Iterator

import pytest

import typer.testing

from atdnode.node import DaemonProcess, NodeHome
from cli.app import app as _atd_app, click_command
from tests.factories import make_consortium
from tests.nodeprocs import start_daemon

# typer's test runner (`CliRunner().invoke(app, ...)`) rebuilds the click command from `app` on
# every call (~40 ms of CPU, most of a short command line's cost); the suite runs thousands of
# command lines in-process, so they share the one `cli.app.click_command` builds (what `atd`
# itself runs). Another Typer app still gets its own.
if hasattr(typer.testing, "_get_command"):
    _typer_get_command = typer.testing._get_command
    typer.testing._get_command = lambda a: click_command() if a is _atd_app else _typer_get_command(a)


# The longest test files, longest first (a file's setup and tests on one worker, from
# `--durations=0` of a whole run). Only the order matters; a file missing here runs after
# them, files with a slow test before the others. tests/test_suite_shape.py checks the names.
LONGEST_FIRST = (
    "test_claims_medmnist.py",  # the shipped RetinaMNIST scenario, one netsim run (~2 min CPU)
    "test_fat.py",
    "test_aggregate_cli.py",  # trains the `skewed` trio (vgs_template) the files after it copy
    "test_readme.py",
    "test_reconstruction.py",
    "test_chaos.py",
    "test_msd.py",
    "test_plans_procs.py",
    "test_plans_examples.py",
    "test_daemon_procs.py",
    "test_netsim_procnet.py",
    "test_split_network.py",
    "test_rounds_procs.py",
    "test_local.py",
    "test_training.py",
    "test_netsim_vgs.py",
    "test_rounds_attacks.py",
    "test_plans.py",
)

# The fast tier's longest files, longest first (`-m "not slow"`, setup and tests of a file
# summed from a run's junit XML). The files in LONGEST_FIRST lose their slow tests there, so
# this order replaces it when no slow test was selected: longest first, short files fill the
# end. The first file to ask `vgs_template` for a trio trains it while its other users wait on
# its lock: test_aggregate_cli trains both, the files beside it use no trio, and the other trio
# users (test_aggregate_skip, test_hierarchical_node, test_classify...) come once they are built.
FAST_LONGEST_FIRST = (
    "test_aggregate_cli.py",  # trains both vgs_template trios in the fast tier
    "test_netsim_faults.py",
    "test_gossip_mesh.py",
    "test_split_compare.py",
    "test_ensemble.py",
    "test_dialer.py",
    "test_bulk_secure.py",
    "test_aggregate_skip.py",
    "test_peerset_daemons.py",
    "test_split_repro.py",
    "test_module_shape.py",
    "test_blobxfer.py",
    "test_hierarchical_node.py",
    "test_training.py",
    "test_rounds.py",
    "test_split_network.py",
    "test_gossip_latency.py",
    "test_transport_contract.py",
    "test_baselines_from_base.py",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--claims", action="store_true",
                     help="also run the `claims` tier (3-seed accuracy claims; minutes per seed)")


@pytest.hookimpl(trylast=True)  # after `-m` deselected: the order depends on what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without `--claims`, deselect the tests marked `claims` (their own tier: they run a
    learning scenario three times, over the suite's budget). Then run the longest files
    first (see `LONGEST_FIRST`, or `FAST_LONGEST_FIRST` when no slow test was selected); a
    file's tests keep their order."""
    if not config.getoption("--claims"):
        out = [item for item in items if item.get_closest_marker("claims")]
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [item for item in items if not item.get_closest_marker("claims")]
    has_slow = {item.path.name for item in items if item.get_closest_marker("slow")}
    first = LONGEST_FIRST if has_slow else FAST_LONGEST_FIRST

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        return (first.index(name) if name in first else len(first), 0 if name in has_slow else 1)

    items.sort(key=rank)  # stable


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary folder (`/tmp/atd...`), removed after the test: daemons' control
    sockets are AF_UNIX paths (at most 107 bytes), too long under xdist's tmp_path."""
    short = Path(tempfile.mkdtemp(prefix="atdt"))
    yield short
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def consortium(tmp_path: Path) -> Callable[[int], list[NodeHome]]:
    """`consortium(n)`: n fresh homes `tmp_path/c<k>/n0..` (n0 founded and admitted the others)."""
    made = 0

    def make(n: int) -> list[NodeHome]:
        nonlocal made
        made += 1
        return make_consortium(tmp_path / f"c{made}", n)

    return make


@pytest.fixture
def procs() -> Iterator[Callable[..., DaemonProcess]]:
    """`procs(home, *args, timeout=60)`: `atd node start` as an OS process, returned once it
    announced itself (`tests.nodeprocs.start_daemon`); every daemon still running when the
    test ends is stopped (SIGTERM, then SIGKILL)."""
    started: list[DaemonProcess] = []

    def start(home: Path | NodeHome, *args: str, timeout: float = 60) -> DaemonProcess:
        d = start_daemon(home, *args, timeout=timeout)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this run sees (the run's base temp without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def vgs_template(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`vgs_template("disjoint" | "skewed")`: the folder of that trained trio (see
    `tests/vgs_homes.py`), built once per run under a file lock. Read-only: copy it
    (`vgs_trio`, or `copy_homes`) before changing anything."""
    from filelock import FileLock

    from tests.vgs_homes import disjoint_trio, skewed_trio

    builders = {"disjoint": disjoint_trio, "skewed": skewed_trio}
    root = _shared_root(tmp_path_factory) / "templates"
    root.mkdir(parents=True, exist_ok=True)

    def get(name: str) -> Path:
        with FileLock(str(root / f"{name}.lock")):
            return builders[name](root / name)

    return get


@pytest.fixture
def vgs_trio(vgs_template, tmp_path: Path) -> Callable[[str], list[NodeHome]]:
    """`vgs_trio("disjoint" | "skewed")`: a private copy of that trained trio's homes (a, b, c)."""
    from tests.vgs_homes import copy_homes

    def get(name: str) -> list[NodeHome]:
        return copy_homes(vgs_template(name), tmp_path / f"{name}-homes")

    return get
