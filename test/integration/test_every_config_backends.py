"""Every shipped config builds with synflux-build (real-size ones shrunk to demo size: same architecture,
heads layout, buckets, KV dtype and heads, small widths) and runs through its node on every backend whose
toolchain runs here (the NPU simulators at "simulator size", see SIMULATORS); a backend other than the
reference first passes synflux-validate against onnxruntime: every graph, greedy chat tokens or action
chunks, and a chat turn reusing the cache against the same turn recomputed on that backend."""
from __future__ import annotations

import glob
import importlib.util
import os

import numpy as np
import pytest
import yaml

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs onnxruntime")

from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.tools.harness import config_path, rgb_image, share_dir  # noqa: E402
from synflux_ros.buildtool.validate import validate  # noqa: E402
from synflux_ros.buildtool.export import build  # noqa: E402

from ros_clients import Harness  # noqa: E402
from ros_clients import ChatClient, ok  # noqa: E402
from checkpoints import demo_size  # noqa: E402

from synflux_ros.backends.rknn.build import RKNNOptions  # noqa: E402
from synflux_ros.backends.rknn.executor import default_simulator_pythons  # noqa: E402

BACKENDS = ["onnxruntime"] + [b for b, module in (("openvino", "openvino"), ("qnn", "onnxruntime_qnn"))
                               if importlib.util.find_spec(module)]
if any(os.path.isfile(p) for p in default_simulator_pythons()):  # the RKNN venv (make rknn-venv)
    BACKENDS.append("rknn")
SIMULATED = {"qnn", "rknn"}  # vendor NPU simulators: make test runs them in a process of their own
CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(share_dir() or "", "config", "*.yaml")))


def _same_graphs_as_an_earlier_config() -> set[str]:
    """Configs whose graphs are another shipped config's (same graph hash: only run-time sections differ,
    e.g. vla_sim_arm's execution): their graph set is already checked on every backend, so they run on
    onnxruntime only."""
    seen, variants = set(), set()
    for name in CONFIGS:
        h = load_config(config_path(name)).graph_hash()
        (variants.add(name) if h in seen else seen.add(h))
    return variants


VARIANTS = _same_graphs_as_an_earlier_config()

# The NPU simulators emulate the device instruction by instruction: Qualcomm's HTP simulator (qnn, x86-64
# here, int32 token ids, target SoC SM8550, fp16 arithmetic) and Rockchip's (rknn, rk3588, fp16; it compiles
# every graph again on each load). They run every config at "simulator size": demo widths, and of the
# config's buckets its smallest prefill bucket and its smallest decode span, which becomes max_seq_len.
# Each bucket is the same graph at another length, and every bucket of every config runs on onnxruntime
# and openvino above. Measured at full demo size, vlm_qwen3 (prefill up to 2048, decode spans up to 4096)
# took ~430 s to validate on the HTP simulator; at simulator size 14 s.
SIMULATORS = ("qnn", "rknn")
QNN_OPTIONS = {"soc_model": 43}
VALIDATE = {"qnn": {"options": QNN_OPTIONS, "precision": "reduced"}, "rknn": {"precision": "reduced"}}


def simulator_size(raw: dict) -> dict:
    llm = raw["llm"]
    llm["prefill_buckets"] = llm["prefill_buckets"][:1]
    llm["decode_buckets"] = llm["decode_buckets"][:1]
    llm["max_seq_len"] = llm["decode_buckets"][0]
    return raw


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each config exported once (demo-sized) per backend flavour, shared by the backends: int64 ids for
    onnxruntime and openvino; simulator size with int32 ids and the qnn options (which the node reads) for
    qnn; simulator size compiled for rk3588 for rknn, each camera in a vision call of its own."""
    cache = {}

    def _get(name: str, backend: str):
        flavour = backend if backend in SIMULATORS else "cpu"
        key = (name, flavour)
        if key not in cache:
            with open(config_path(name), encoding="utf-8") as fh:
                raw = demo_size(yaml.safe_load(fh))
            kw = {}
            if flavour in SIMULATORS:
                simulator_size(raw)
            if flavour == "qnn":
                raw["llm"]["token_id_dtype"] = "int32"
                raw.setdefault("executor", {})["options"] = dict(QNN_OPTIONS)
            elif flavour == "rknn":
                kw = {"backend": "rknn", "options": RKNNOptions(target="rk3588")}
                if raw.get("vision"):  # what the rknn builder asks of a GR00T config (one image per call)
                    raw["vision"]["batch_cameras"] = False
            d = tmp_path_factory.mktemp(f"{name.replace('.yaml', '')}_{flavour}")
            (d / name).write_text(yaml.safe_dump(raw))
            build(load_config(str(d / name)), str(d / "graphs"), **kw)
            cache[key] = d / "graphs"
        return cache[key]
    return _get


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.simulator) if b in SIMULATED else b
                                     for b in BACKENDS])
@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_and_runs_on_its_node(name, backend, built, start_node, client):
    if name in VARIANTS and backend != "onnxruntime":
        pytest.skip(f"{name} has the graphs of another shipped config, which runs on {backend}")
    out = built(name, backend)
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.executor.backend == ("rknn" if backend == "rknn" else "onnxruntime")  # what synflux-build wrote
    if backend != "onnxruntime":
        failed = [r for r in validate(str(out), backend, **VALIDATE.get(backend, {})) if not r.passed]
        assert not failed, failed
    ns = "/" + name.replace(".yaml", "") + "_" + backend
    # Hang guards, not speed requirements: a simulated frame or turn takes seconds, and `make test` runs the
    # simulator cases at a lower CPU priority beside the other tests.
    wait = 240.0 if backend in SIMULATORS else 60.0
    if cfg.mode == "vla":
        start_node("vla_node", {"config": str(out / "config.yaml"), "executor": backend}, namespace=ns)
        cams = cfg.vision.cameras
        h = Harness(client, ns, state_joints=cfg.action.state_joints, camera=cams[0] if cams else "", others=cams[1:])
        h.wait_connected(timeout=wait)
        h.publish_until_chunks(1, lambda s, t: rgb_image(480, 640, s, t), timeout=wait, period=0.5)
        c = h.chunks[-1]
        assert (c.horizon, c.action_dim) == (cfg.action.action_horizon, cfg.action.published_dim)
        assert c.vision_device.startswith(backend) and c.backbone_device.startswith(backend) \
            and c.head_device.startswith(backend)
        actions = np.array(c.actions)
        assert actions.size == c.horizon * c.action_dim and np.all(np.isfinite(actions))
        if cfg.action.head_type == "autoregressive" and cfg.action.norm_q01:
            lo, hi = np.array(cfg.action.norm_q01), np.array(cfg.action.norm_q99)
            a = actions.reshape(c.horizon, c.action_dim)[:, :6]
            assert np.all(a >= lo[:6] - 1e-6) and np.all(a <= hi[:6] + 1e-6)
        if backend in SIMULATORS:
            # A frame takes seconds on the simulator: let the frames in flight finish before the node is
            # stopped (the pipeline waits 5 s for its stages on shutdown).
            h.diag_where(lambda d: int(d["frames_published"]) >= len(h.chunks) and d["frames_in_flight"] == "0",
                         timeout=wait)
    else:
        start_node("vlm_node", {"config": str(out / "config.yaml"), "executor": backend}, namespace=ns)
        c = ChatClient(client, ns, timeout=wait)
        images = [rgb_image(96, 128, 1)] if cfg.vision is not None else []  # text-only models take none
        r1 = ok(c.chat("s", "What is in front of the robot?", images=images, max_new_tokens=4, temperature=0.0))
        r2 = ok(c.chat("s", "And behind it?", max_new_tokens=4, temperature=0.0))
        assert r1.generated_tokens >= 1 and r2.cached_tokens > 0
        # validate (above) checked the reused turn against the turn recomputed on this backend
