"""Ledger replication: gossip in and out, sync, anti-entropy, the own chain and the membership gate."""
