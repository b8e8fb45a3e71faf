"""Shared pytest setup: tests import the installed package (see the Makefile's `test` target)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "tensorrt_gpu: needs JetPack's TensorRT and a CUDA device (a Jetson); "
                                       "skipped elsewhere with the reason")
