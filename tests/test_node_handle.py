"""A node opened once: `NodeHandle` opens its config, ledger, blob store and registry on first use
and keeps them; one `atd train` / `atd publish-weights` / `atd aggregate` / `atd classify` opens
each part at most once and parses its data spec once (counted on the real commands)."""
from __future__ import annotations

import collections
import pickle

import pytest

import atdnode.data.loader as loader
from atdnode.blobs import BlobStore
from atdnode.errors import ConfigError
from atdnode.models import ModelRegistry
from atdnode.node import NodeConfig, NodeHandle, NodeHome, open_node
from atdnode.data import DataSpec
from ledger import Ledger
from tests.factories import cli, cli_json
from tests.vgs_homes import sync

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")

TINY = ["--img-size", "16", "--patch-size", "8", "--embed-dim", "32", "--depth", "1", "--heads", "2"]


def test_parts_open_once_and_the_ledger_closes(consortium, tmp_path):
    (home,) = consortium(1)
    node = open_node(home.root)
    assert isinstance(node, NodeHome) and node == home and home == node and {home: 1}[node] == 1
    assert node.ledger_db == home.ledger_db
    assert node.config is node.config and node.config.name == NodeConfig.load(home).name
    assert BlobStore.of(node) is BlobStore.of(node) and BlobStore.of(node).root == home.blobs_dir
    assert ModelRegistry.of(node) is ModelRegistry.of(node) and ModelRegistry.of(node).dir == home.models_dir
    led = node.ledger
    assert led is node.ledger and led.query(kind="genesis")
    assert NodeHandle.of(node) is node and NodeHandle.of(home) is not NodeHandle.of(home)  # a plain home: its own
    with pytest.raises(TypeError):
        pickle.dumps(led)  # what a handle must never carry to another process ...
    copy = pickle.loads(pickle.dumps(node))  # ... and does not: only the folder travels
    assert copy == node and "ledger" not in copy.__dict__
    with node:
        pass
    with pytest.raises(Exception):
        led.query(kind="genesis")  # closed with the handle
    assert node.ledger.query(kind="genesis")  # a later use opens it again
    node.close()
    with NodeHandle.using(node) as same:  # a handle lent to a block stays open ...
        assert same is node and same.ledger
    assert "ledger" in node.__dict__
    with NodeHandle.using(home) as own:  # ... one opened for the block closes after it
        own_led = own.ledger
    with pytest.raises(Exception):
        own_led.query(kind="genesis")
    node.close()
    with pytest.raises(ConfigError, match="atd init"):
        open_node(tmp_path / "nowhere")


@pytest.fixture
def counted(monkeypatch):
    """Counts of config loads, ledger / blob store / registry opens, data spec parses,
    catalogue scans and handles closed with an open ledger, reset by the test between commands."""
    n: collections.Counter = collections.Counter()

    def count_classmethod(cls, name, key):
        fn = cls.__dict__[name].__func__

        def wrapped(c, *a, **k):
            n[key] += 1
            return fn(c, *a, **k)
        monkeypatch.setattr(cls, name, classmethod(wrapped))

    def count_init(cls, key):
        init = cls.__init__

        def wrapped(self, *a, **k):
            n[key] += 1
            init(self, *a, **k)
        monkeypatch.setattr(cls, "__init__", wrapped)

    count_classmethod(NodeConfig, "load", "config")
    count_classmethod(Ledger, "open", "ledger")
    count_classmethod(DataSpec, "parse", "spec")
    count_init(BlobStore, "store")
    count_init(ModelRegistry, "registry")
    close = NodeHandle.close

    def closing(self):
        n.update(["closed with its ledger"] if "ledger" in self.__dict__ else [])
        close(self)
    monkeypatch.setattr(NodeHandle, "close", closing)
    scan = loader.open_catalog
    monkeypatch.setattr(loader, "open_catalog", lambda *a, **k: (n.update(["catalogue"]), scan(*a, **k))[1])
    return n


def test_a_command_opens_each_part_once_and_parses_its_data_once(consortium, counted):
    a, b = consortium(2)
    seen = {}

    def run(name, *args, as_json=True):
        counted.clear()
        (cli_json if as_json else cli)(*args)
        seen[name] = dict(counted)

    run("train a", "train", "--home", str(a.root), "--data", "digits?classes=0,1,2&limit=120", "--epochs", "1",
        *TINY, as_json=False)
    # sizes from the data: the spec is read once for them and for the three splits
    run("train b", "train", "--home", str(b.root), "--data", "digits?classes=0,1,2&limit=90&seed=1", "--epochs", "1",
        as_json=False)
    for h in (a, b):
        run(f"publish {h.root.name}", "publish-weights", "--home", str(h.root))
    sync([a, b])
    run("aggregate", "aggregate", "--home", str(a.root), "--mode", "horizontal", "--classifier", "head")
    run("classify", "classify", "--home", str(a.root), "--data", "digits?classes=0,1,2&limit=60")
    for name, n in seen.items():
        assert all(n.get(part, 0) <= 1 for part in ("config", "ledger", "store", "registry")), (name, n)
    for name in ("train a", "train b", "aggregate"):
        assert seen[name]["spec"] == 1 and seen[name]["catalogue"] == 1, (name, seen[name])
    assert seen["classify"]["catalogue"] == 1  # its split chosen and read from one listing (it also parses
    # the model's own training spec, to compare sources)
    assert seen["train a"]["store"] == seen["aggregate"]["ledger"] == 1  # counted where they are opened
    for name in ("publish n0", "publish n1", "aggregate"):  # the command closed the ledger it opened
        assert seen[name]["ledger"] == seen[name]["closed with its ledger"] == 1, (name, seen[name])
