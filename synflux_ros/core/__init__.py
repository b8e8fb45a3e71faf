"""The contract every other layer builds on: configs, the graph set of a config and its files on disk,
the executor base class with its static memory pool and KV-cache slots, image decoding and
preprocessing, and the threaded stage pipeline. numpy, PyYAML and the standard library only."""
