"""What a split campaign sees of the service that hosts it.

`SplitService` (`service.py`) owns the streams, the ledger and the service directory; a
campaign (`campaign.py`: FESTA / p-FESTA, `msd_campaign.py`: MSD) runs the rounds and talks
to clients through the service. The service creates its campaign, so a campaign knows the
service only as this interface, `CampaignHost`, which `SplitService` implements: the
dependency points one way (service -> campaign -> host), with no import circle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from atdnode.node import NodeHome
from atdnode.split.rounds import Board, Member
from atdnode.split.session import SplitChannel
from atdnode.split.settings import SplitSettings
from protocols.comm_cost import ByteCounter


@dataclass
class Session:
    """One client stream being served."""

    client: str
    channel: SplitChannel
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    admitted: bool = False
    clean: bool = False  # the client said bye
    dropped: str | None = None  # why the coordinator cancelled this session (told to the client)


class CampaignHost(Protocol):
    """The service as a campaign uses it (`SplitService` is the one implementation)."""

    home: NodeHome
    algorithm: str  # "festa" | "pfesta" | "msd"
    settings: SplitSettings | None  # set before the campaign is made
    board: Board | None  # set before the campaign is made
    dir: Path  # HOME/split/server/<algorithm>/: the campaign's saved state
    counter: ByteCounter  # every byte of every session
    daemon: Any  # the node daemon: transport, ledger, store, append
    sessions: dict[str, Session]  # client peer id -> its live admitted session
    service_entry: str | None  # the signed `service` entry this campaign runs under
    secret_entry: str | None  # p-FESTA / MSD: the adopted `split_secret` entry
    round_observers: list  # awaited with the round number after each saved round

    @property
    def offer(self) -> dict[str, Any]: ...

    def read_json(self, name: str) -> Any | None: ...

    def write_json(self, name: str, data: Any) -> None: ...

    async def recv(self, sess: Session, *kinds: str) -> Any: ...

    async def drop(self, client: str, reason: str, *, current: Session | None = None) -> None: ...

    async def check_member(self, client: str) -> None: ...

    def member(self, client: str) -> Member: ...

    def join_fields(self, frame: Any) -> tuple[str, int, int | None, bool]: ...
