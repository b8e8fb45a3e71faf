"""Serving over the network: openpi's policy protocol on Ray Serve (``synflux-serve``)."""
