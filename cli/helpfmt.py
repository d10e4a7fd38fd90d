"""How `atd --help` lists its commands: grouped in the order a hospital uses them.

Help is plain click text (the root app sets `rich_markup_mode=None`, which every sub-app
inherits), so square brackets in help strings (`[models] max_bytes`,
`pip install 'atd[tensorboard]'`) are printed as written and flags show no value.
A command that no section names (a new one) is listed under "Other", never hidden.
"""
from __future__ import annotations

import typer.core

# (section title, commands in workflow order)
WORKFLOW: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Set up a node", ("init", "id", "config", "key", "member")),
    ("Run the daemon", ("node", "local", "peers")),
    ("Train on local data", ("data", "train", "classify", "predict", "models")),
    ("Share and combine", ("publish-weights", "share-features", "fetch", "aggregate", "rounds", "split", "base")),
    ("Audit", ("ledger", "report")),
    ("Simulate", ("demo", "netsim")),
)


def workflow_order(names: list[str]) -> list[tuple[str, list[str]]]:
    """`names` grouped into WORKFLOW's sections (empty ones dropped), the rest under "Other"."""
    placed: set[str] = set()
    out: list[tuple[str, list[str]]] = []
    for title, members in WORKFLOW:
        here = [n for n in members if n in names]
        placed.update(here)
        if here:
            out.append((title, here))
    rest = sorted(n for n in names if n not in placed)
    if rest:
        out.append(("Other", rest))
    return out


class WorkflowGroup(typer.core.TyperGroup):
    """The root group: `list_commands` in workflow order, help in one section per step."""

    def list_commands(self, ctx) -> list[str]:
        return [n for _, names in workflow_order(list(self.commands)) for n in names]

    def format_commands(self, ctx, formatter) -> None:
        pad = max((len(n) for n in self.commands), default=0)  # one column for every section
        for title, names in workflow_order(list(self.commands)):
            rows = []
            for n in names:
                cmd = self.get_command(ctx, n)
                if cmd is not None and not cmd.hidden:
                    rows.append((n.ljust(pad), cmd.get_short_help_str(limit=300)))  # wrapped, not cut
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
