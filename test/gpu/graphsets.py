"""Demo graph sets for the GPU tests, with the tensorrt backend's profiled ONNX files.

Building one needs torch (``synflux-build``); a GPU machine may not have it, so they are built ahead
into ``.gpu-carry/graphs/<config stem>/`` (ignored by git, carried to the device) with::

    python test/gpu/graphsets.py            # every config of CONFIGS

and :func:`graph_set` copies a carried set (or builds one where torch is importable).
"""
from __future__ import annotations

import os
import shutil
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CARRY = os.path.join(ROOT, ".gpu-carry", "graphs")
CONFIG = os.path.join(ROOT, "config")
CONFIGS = ("vlm_demo.yaml", "vla_demo_orin.yaml", "vla_pi0.yaml+vjp", "vla_smolvla.yaml", "vla_pi05.yaml+vjp")
"""``+vjp``: the config with Real-Time Chunking's vjp guidance (adds the action_expert_vjp graphs and engine)."""


def build_graph_set(name: str, out_dir: str) -> str:
    """``config/<name>`` shrunk with ``checkpoints.demo_size`` (``<name>+vjp``: with the vjp guidance), built into
    ``out_dir/graphs`` (graph set + ``tensorrt/onnx``); returns the graph set directory."""
    sys.path.insert(0, os.path.dirname(HERE))  # test/: checkpoints
    from checkpoints import demo_size
    from synflux_ros.backends.tensorrt.build import export_profiled
    from synflux_ros.buildtool.export import build
    from synflux_ros.core.config import load_config
    os.makedirs(out_dir, exist_ok=True)
    name, _, extra = name.partition("+")
    with open(os.path.join(CONFIG, name), encoding="utf-8") as fh:
        raw = demo_size(yaml.safe_load(fh))
    if extra == "vjp":
        raw["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
    cfg_path = os.path.join(out_dir, name)
    with open(cfg_path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    cfg = load_config(cfg_path)
    out = os.path.join(out_dir, "graphs")
    manifest = build(cfg, out)
    export_profiled(cfg, out, manifest, None, 0, False, progress=lambda *_: None)
    return out


def carried(name: str) -> str:
    return os.path.join(CARRY, _stem(name), "graphs")


def _stem(name: str) -> str:
    """vla_pi0.yaml+vjp -> vla_pi0-vjp"""
    base, _, extra = name.partition("+")
    return base.rsplit(".", 1)[0] + (f"-{extra}" if extra else "")


def graph_set(name: str, dest: str) -> str | None:
    """A fresh copy of the demo graph set of ``name`` under ``dest`` (tests write engines into it): the
    carried one, else built here when torch is importable; None when neither is possible."""
    src = carried(name)
    if os.path.isfile(os.path.join(src, "manifest.json")):
        out = os.path.join(dest, "graphs")
        shutil.copytree(src, out)
        return out
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    return build_graph_set(name, dest)


if __name__ == "__main__":
    for config in sys.argv[1:] or CONFIGS:
        d = os.path.join(CARRY, _stem(config))
        shutil.rmtree(d, ignore_errors=True)
        print(config, "->", build_graph_set(config, d))
