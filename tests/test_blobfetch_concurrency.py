"""Concurrent `BlobFetcher.fetch` calls for one blob share one download at a time.

Regression: when a download failed, the callers queued behind it each looked at the store
(an await) and could both start a download; the second one's bookkeeping then raised
KeyError inside the daemon's fetch loop and stopped the daemon. The transfer itself is
replaced here (this tests the fetcher's guard, not the wire; test_blobxfer covers that).
"""
from __future__ import annotations

from pathlib import Path

import trio

from atdnode.blobs import BlobStore, FetchError
from atdnode.blobs.fetch import BlobFetcher

BLOB = "ab" * 32


def test_callers_behind_a_failed_fetch_never_run_two_downloads(tmp_path: Path) -> None:
    fetcher = BlobFetcher(transport=None, store=BlobStore(tmp_path / "blobs"))  # type: ignore[arg-type]
    running, peak, calls = 0, 0, 0

    async def flaky_fetch(blob: str, peers: list[str], manifest_hash: str | None) -> str:
        nonlocal running, peak, calls
        calls += 1
        running += 1
        peak = max(peak, running)
        try:
            await trio.sleep(0.01)
            raise FetchError(f"no holder of {blob[:12]} (attempt {calls})")
        finally:
            running -= 1

    fetcher._fetch = flaky_fetch  # type: ignore[method-assign]
    outcomes: list[str] = []

    async def one(delay: float) -> None:
        await trio.sleep(delay)
        try:
            await fetcher.fetch(BLOB, ["peer"])
        except FetchError:
            outcomes.append("FetchError")

    async def main() -> None:
        async with trio.open_nursery() as n:
            for k in range(8):
                n.start_soon(one, 0.001 * k)

    trio.run(main)
    assert outcomes == ["FetchError"] * 8  # every caller got the typed error, none a KeyError
    assert peak == 1 and calls >= 2  # callers retried one after another, never two at once
    assert fetcher._active == {}


def test_a_caller_finding_the_blob_stored_returns_without_downloading(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    blob = store.put_bytes(b"x" * 1000)
    fetcher = BlobFetcher(transport=None, store=store)  # type: ignore[arg-type]

    async def never(*_a) -> str:
        raise AssertionError("downloaded a blob already in the store")

    fetcher._fetch = never  # type: ignore[method-assign]
    assert trio.run(fetcher.fetch, blob, ["peer"]) == blob
