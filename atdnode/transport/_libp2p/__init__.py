"""Private: atd's adjustments of py-libp2p, which `Libp2pTransport` installs.

They reach into py-libp2p's internals, so they are written for one version (`WRITTEN_FOR`)
and refuse to load on any other: importing this package raises `Libp2pVersionError`
(a `TransportError`: one line at the CLI) naming both versions.

What each module changes, and why:

* `swarm`: an inbound connection's slot (py-libp2p admits 250 inbound connections at a time)
  is released when the connection closes, not when the swarm stops; `Swarm.close_peer` no
  longer unlists connections it did not close. Without both, refused dials and members that
  come and go used slots up for good and locked every peer out.
* `window`: yamux receive windows enforced, on stock `Yamux` and `TunedYamux` alike. A peer
  sending past the window it was granted is disconnected and its bytes dropped; py-libp2p
  logged it and kept the bytes, so a stream the node never reads grew without bound.
* `yamux`: `TunedYamux`, the muxer atd offers (same /yamux/1.0.0 wire): DATA frames of up to
  1 MiB within the peer's window, event-driven window waits, a 4 MiB window on the streams
  it opens, one copy per byte through Noise; `MuxerMultistream.new_conn` builds the Yamux
  subclass it was given; Noise writes longer than one message leave in one socket write.
  Why: stock py-libp2p moved bulk data at a small fraction of TCP's speed.
* `pubsub`: cheaper GossipSub per message (coalesced sends, buffered reads, duplicates dropped
  before any work, content-addressed message ids, no pubsub signature checks: every entry
  is signed and checked by the daemon), whole RPCs per stream write (a half-written RPC
  resets the stream), the membership gate in front of the router both ways, flood publish
  of the node's own messages, batched yamux credit, rare RTT pings, buffered raw reads,
  cached addresses and peer records. Why: py-libp2p's cost per message bounded gossip
  latency, and its concurrent writers could interleave two RPCs on one stream.
* `gossip_mesh`: an empty mesh cannot persist (backoff on our own prunes, GRAFTs accepted
  while under D_low, flood relay while empty), a fixed heartbeat cadence (fast while the
  mesh needs work, slow when idle) instead of adaptive gossip, a thin mesh in small consortia. Why: py-libp2p's backoff rules
  could leave a node's mesh empty for good, and opportunistic grafting filled every mesh.
* `host`: the host's configuration (GossipConfig, larger pubsub queues: py-libp2p drops
  messages when its 32-entry queues are full), `forget_dial_state` (a dial goes to the
  address asked for, past py-libp2p's 60 s negative cache), `check_listening` (a failed
  listen is an error, not a log line), `no_auto_connector` (which peers to dial is the
  daemon's decision).
* `tcp_exclusive`: TCP listeners without SO_REUSEPORT, so no other process of the user can
  bind the daemon's port beside it and receive a share of its connections.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from atdnode.transport.base import Libp2pVersionError

WRITTEN_FOR = "0.8.1"  # the py-libp2p version these patches were written against


def installed_version() -> str | None:
    """The installed py-libp2p distribution's version, or None when it is not installed."""
    try:
        return version("libp2p")
    except PackageNotFoundError:
        return None


def check_version(found: str | None) -> None:
    """Raise `Libp2pVersionError` unless `found` is the version the patches were written for."""
    if found != WRITTEN_FOR:
        raise Libp2pVersionError(
            f"atd's py-libp2p patches are written for py-libp2p {WRITTEN_FOR}, found {found or 'none installed'}: "
            f"install libp2p=={WRITTEN_FOR}")


check_version(installed_version())
