"""Blobs: the content-addressed store, reader lists, and moving blobs between members."""
