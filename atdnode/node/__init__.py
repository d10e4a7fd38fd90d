"""The node itself: its home, identity, configuration, daemon and local control."""
