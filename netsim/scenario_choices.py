"""The choices of the scenario keys that take one of a fixed set of names, declared once.

`netsim.scenario_spec` declares the keys that take them; the CLI builds its `--backend`,
`--method` and `--base` options from them. This module loads only the standard library, so
the `atd` command line can list the choices in its help without loading the simulator.
"""
from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    MEMORY = "memory"  # in-process nodes over an in-memory transport (netsim.memsim)
    PROCESS = "process"  # one `atd node start` process per node (netsim.procnet)


class Method(StrEnum):
    VGS_ATD = "vgs-atd"
    CENTRALIZED = "centralized"
    FEDAVG = "fedavg"
    SWARM = "swarm"
    LOCAL = "local"
    FAT_FEDAVG = "fat-fedavg"  # adversarial `atd rounds` (netsim.fat), opt-in
    FAT_FEDWAVG = "fat-fedwavg"
    PLAN = "plan"  # carries out [scenario] plan on the nodes (netsim.plan)


class Base(StrEnum):
    SCRATCH = "scratch"
    MSD = "msd"  # VGS-ATD starts from a base the nodes build by masked sampling distillation (netsim.msdbase)
    PUBLIC = "public"  # every method starts from W_p, a designated client's ViT on a public pool (netsim.publicbase)


class Partition(StrEnum):
    IID = "iid"
    LABEL_SKEW = "label_skew"
    QUANTITY_SKEW = "quantity_skew"
    DISJOINT = "disjoint"
    NON_IID2 = "non_iid2"  # non_iid*: the FedWAvg paper's
    NON_IID4 = "non_iid4"
    CLASS_SHARES = "class_shares"


class FaultKind(StrEnum):
    KILL = "kill"
    RESTART = "restart"
    PARTITION = "partition"
    HEAL = "heal"
    SLOW_LINK = "slow_link"
    LATE_JOIN = "late_join"
    LEAVE = "leave"


class GroupStart(StrEnum):
    """Where a new group of a hierarchical phase starts (netsim.vgs._hierarchical)."""

    BASE = "base"  # the consortium's shared base (the paper, §3.3)
    CONSORTIUM = "consortium"  # the latest fused extractor of the consortium's existing group (a deviation)


class Peers(StrEnum):
    DAEMON = "daemon"  # NodeDaemon
    LITE = "lite"  # gossip-only, for 1000+ nodes
