"""Peers: whom a daemon stays connected to, at which addresses, and how it dials them."""
