"""Heads: what turns the backbone's prefix into an output (action chunk or text)."""
