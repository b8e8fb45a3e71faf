"""Which runtime a config opens: the same choice for both nodes, by mode and by ``executor.backend``."""
from __future__ import annotations

import pytest

from synflux_ros.core.config import load_config
from synflux_ros.runtimes import open_runtime, runtime_class
from synflux_ros.runtimes.remote import RemoteVLARuntime
from synflux_ros.runtimes.remote_chat import RemoteVLMRuntime
from synflux_ros.runtimes.vla import VLARuntime
from synflux_ros.runtimes.vlm import VLMRuntime
from synflux_ros.tools import harness as testing


@pytest.mark.parametrize("config,url,local,remote", [
    ("vla_demo_orin.yaml", "ws://policy:8000/", VLARuntime, RemoteVLARuntime),
    ("vlm_demo.yaml", "http://gpu-server:8000/v1", VLMRuntime, RemoteVLMRuntime),
])
def test_a_remote_backend_opens_the_remote_runtime_of_the_mode(config, url, local, remote):
    cfg = load_config(testing.config_path(config))
    assert runtime_class(cfg) is local
    assert runtime_class(cfg.with_overrides(executor={"backend": "remote"}, remote={"url": url})) is remote


def test_a_local_config_opens_a_loaded_runtime():
    rt = open_runtime(load_config(testing.config_path("vla_demo_orin.yaml")))
    try:
        assert isinstance(rt, VLARuntime) and rt.executor.device_bytes > 0
    finally:
        rt.close()
