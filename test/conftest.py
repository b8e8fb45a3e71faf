"""Shared pytest setup: tests import the installed package (see the Makefile's `test` target)."""
