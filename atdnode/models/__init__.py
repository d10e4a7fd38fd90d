"""The node's models: the registry, weights as blobs, publishing and garbage collection."""
