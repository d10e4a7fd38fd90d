"""Shape of the code: no import circle anywhere (issue 28; VGS-ATD modules since issue 12).

Imports are read statically (every `import` / `from ... import`, also those inside
functions: a deferred import that closes a circle is still a circle a reader must untangle).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ledger", "atdnode", "protocols", "netsim", "cli")
# the math in protocols/, the node-level steps in atdnode/, the simulator's driver in netsim/
VGS_MODULES = ("protocols.aggregation", "protocols.aggregation_error", "protocols.fedwavg", "protocols.vgs",
               "protocols.hierarchical", "protocols.ensemble", "atdnode.aggregate", "atdnode.agg_check",
               "atdnode.agg_verify", "atdnode.horizontal", "atdnode.vertical", "atdnode.hierarchical_node",
               "atdnode.node_ensemble", "atdnode.features_share", "atdnode.publish", "atdnode.bodies",
               "atdnode.augment", "netsim.vgs", "netsim.vgs_ops")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a.b import c` counts a.b.c when that is
    a module, else a.b; the same rule as shared/tools/import_graph.py)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a.b import c` is an arrow to a.b.c when that is a module, else to a.b
                deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                            for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles_through(graph: dict[str, set[str]], members: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module that contain one of `members`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 and members & set(comp):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_runs_through_a_vgs_module():
    graph = import_graph()
    missing = [m for m in VGS_MODULES if m not in graph]
    assert not missing, f"VGS_MODULES names modules that do not exist: {missing}"
    assert cycles_through(graph, set(VGS_MODULES)) == []


def test_protocols_import_from_atdnode_only_the_model_config():
    """Layers import downward (INTERFACES.md); the one exception is the ViT configuration
    class, `atdnode.model.ModelConfig`, which shapes the split-learning parts too. So
    `atdnode.model` itself must stay a leaf: torch, timm and `atdnode.errors` at load time."""
    graph = import_graph()
    allowed = {"atdnode", "atdnode.model", "atdnode.errors"}
    for name, deps in graph.items():
        if name.startswith("protocols"):
            up = {d for d in deps if d.split(".")[0] in ("atdnode", "netsim", "cli")}
            assert up <= allowed, f"{name} imports {sorted(up - allowed)}"
    tree = ast.parse((ROOT / "atdnode" / "model.py").read_text())
    top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert {m for m in top if m.split(".")[0] in PACKAGES} == {"atdnode.errors"}


# Circles that still exist, each to be untangled; this list may only shrink (a new circle, or
# an old one that grows, fails the test; a circle that is gone must be removed from here).
KNOWN_CIRCLES: list[list[str]] = [
    ["atdnode.split", "atdnode.split.campaign", "atdnode.split.msd_campaign", "atdnode.split.service"],
    ["netsim.scenario", "netsim.scenario_check"],
]


def test_no_import_circle_beyond_the_known_ones_and_the_list_only_shrinks():
    graph = import_graph()
    found = cycles_through(graph, set(graph))
    assert [c for c in found if c not in KNOWN_CIRCLES] == [], "a new import circle (or a known one grew)"
    gone = [c for c in KNOWN_CIRCLES if c not in found]
    assert gone == [], f"these circles are gone: remove them from KNOWN_CIRCLES: {gone}"


def test_ground_layers_import_nothing_above_them():
    """ledger imports nothing of ours but ledger; protocols imports only ledger and itself,
    apart from the one known upward arrow (`atdnode.model`, checked above)."""
    graph = import_graph()
    for name, deps in graph.items():
        top = name.split(".")[0]
        if top == "ledger":
            assert {d for d in deps if not d.startswith("ledger")} == set(), name
        if top == "protocols":
            up = {d for d in deps if d.split(".")[0] in ("netsim", "cli")}
            assert up == set(), f"{name} imports {sorted(up)}"


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert cycles_through(graph, {"a"}) == [["a", "b", "c"]]
    assert cycles_through(graph, {"d"}) == []
