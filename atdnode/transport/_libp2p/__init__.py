"""Private: the py-libp2p 0.8.1 adjustments `Libp2pTransport` installs."""
