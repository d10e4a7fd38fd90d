"""`Libp2pBytes`: a py-libp2p stream as the `framing.ByteStream` that `FramedStream` reads
and writes. py-libp2p's errors become
`TransportError`; its end of stream becomes an empty read."""
from __future__ import annotations

import logging
from typing import Any

from libp2p.network.stream.exceptions import StreamEOF

from atdnode.transport.base import TransportError

log = logging.getLogger(__name__)


class Libp2pBytes:
    """framing.ByteStream over a libp2p NetStream; maps libp2p errors to TransportError."""

    def __init__(self, stream: Any) -> None:
        self.s = stream

    async def receive_some(self, max_bytes: int) -> bytes:
        try:
            return await self.s.read(max_bytes)
        except StreamEOF:
            return b""
        except Exception as e:
            raise TransportError(f"stream read failed: {type(e).__name__}: {e}") from e

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.s.write(bytes(data))
        except Exception as e:
            raise TransportError(f"stream write failed: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        try:
            await self.s.close()
        except Exception as e:  # closing a broken stream is not an error worth raising
            log.debug("stream close: %s", e)

    async def abort(self) -> None:
        try:
            await self.s.reset()
        except Exception as e:
            log.debug("stream reset: %s", e)

