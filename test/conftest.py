"""Shared pytest setup: tests import the installed package (see the Makefile's `test` target)."""
import os
import tempfile

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "tensorrt_gpu: needs JetPack's TensorRT and a CUDA device (a Jetson); "
                                       "skipped elsewhere with the reason")


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_basetemp(tmp_path_factory):
    """The temporary files of the tests and of the processes they start (node logs, ROS log directories,
    simulator worker logs) go under the session's base directory, which the next run replaces, rather than
    piling up in the system's temporary directory."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp", numbered=False))
    tempfile.tempdir = None  # tempfile caches the directory it chose
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None
