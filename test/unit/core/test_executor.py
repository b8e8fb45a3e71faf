"""Executor base class (contracts, static pool, staging groups) and the backend registry."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import synflux_ros.backends as backends
from synflux_ros.backends import (
    BackendEntry,
    BackendUnavailableError,
    UnknownBackendError,
    available_backends,
    build_executor,
    resolve_executor_class,
)
from synflux_ros.backends.mock.executor import MockExecutor
from synflux_ros.core.executor import DeviceTensor, Executor, GraphNotFoundError, ShapeError
from synflux_ros.core.contract import GraphMeta, TensorSpec
from synflux_ros.graphset import reader as graphset
from synflux_ros.core.kv_cache import KVCachePool
from synflux_ros.core.memory import PoolFrozenError, StaticMemoryPool
from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.core.contract import graph_set, select_bucket
from synflux_ros.model.backbone import LLMBackbone
from synflux_ros.runtimes.base import create_executor, load_graph_metas

ROOT = Path(__file__).resolve().parents[3]
CONFIG_DIR = ROOT / "config"


# ------------------------------------------------------------------ a minimal backend

class HostExecutor(Executor):
    """Backend with byte buffers in host memory; graphs compute out = a + b (or a + kv.sum())."""

    name = "host"

    def __init__(self, graphs, graph_dir="", options=None):
        super().__init__(graphs, graph_dir, options)
        self.mem = {}
        self.loaded_paths = []
        self.freed = []

    def _load_graph(self, path, meta):
        self.loaded_paths.append(path)
        return meta.name

    def _execute(self, handle, device_inputs, device_outputs, meta):
        vals = {s.name: self._d2h(device_inputs[s.name], s.shape, s.dtype) for s in meta.inputs}
        out = meta.outputs[0]
        if "kv" in vals:
            res = vals["a"] + vals["kv"].sum()
        else:
            res = vals["a"] + vals["b"]
        self._h2d(np.ascontiguousarray(res.astype(out.dtype)), device_outputs[out.name])

    def _alloc_device(self, nbytes):
        h = len(self.mem) + 1
        self.mem[h] = bytearray(nbytes)
        return h

    def _h2d(self, data, buf):
        raw = data.tobytes()
        self.mem[buf][:len(raw)] = raw

    def _d2h(self, buf, shape, dtype):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return np.frombuffer(bytes(self.mem[buf][:n]), dtype=dtype).reshape(shape).copy()

    def _free_device(self, buf):
        self.freed.append(buf)


def add_graph(name="add", shape=(2, 3), group="", file=""):
    return GraphMeta(name, "add", (TensorSpec("a", shape, "float32"), TensorSpec("b", shape, "float32")),
                     (TensorSpec("out", shape, "float32"),), group=group, file=file)


def kv_graph():
    return GraphMeta("kvsum", "add", (TensorSpec("a", (4,), "float32"),
                                      TensorSpec("kv", (2, 5), "float32", resident=True)),
                     (TensorSpec("out", (4,), "float32"),))


def staging_bytes(graphs) -> int:
    """Bytes the executor should allocate for staging: per group and tensor name, the largest size."""
    sizes = {}
    for g in graphs:
        for s in g.inputs + g.outputs:
            if not s.resident:
                sizes[(g.group, s.name)] = max(sizes.get((g.group, s.name), 0), s.nbytes)
    return sum(sizes.values())


# ------------------------------------------------------------------ specs

def test_tensor_spec_and_graph_meta_round_trip():
    spec = TensorSpec("past_kv", (2, 2, 4, 8, 16), "float16", resident=True)
    assert spec.nbytes == 2 * 2 * 4 * 8 * 16 * 2
    assert TensorSpec.from_dict(spec.to_dict()) == spec
    meta = GraphMeta("g", "prefill", (spec,), (TensorSpec("logits", (1, 10), "float32"),),
                     group="prefill", file="g.onnx", attrs={"bucket": 8})
    again = GraphMeta.from_dict(meta.to_dict())
    assert again == meta and again.attrs == {"bucket": 8}
    assert GraphMeta("solo", "embed", (), ()).group == "solo"
    assert meta.input("past_kv") is spec
    with pytest.raises(KeyError, match="no input 'nope'"):
        meta.input("nope")
    with pytest.raises(KeyError, match="no output 'nope'"):
        meta.output("nope")


def test_select_bucket():
    assert select_bucket((32, 128), 1) == 32
    assert select_bucket((32, 128), 32) == 32
    assert select_bucket((32, 128), 33) == 128
    with pytest.raises(ValueError, match="exceeds the largest bucket 128"):
        select_bucket((32, 128), 129)


# ------------------------------------------------------------------ contracts

@pytest.fixture
def host():
    ex = HostExecutor([add_graph(), kv_graph()], graph_dir="/graphs")
    ex.load()
    yield ex
    ex.close()


def test_run_computes_and_records_stats(host):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = host.run("add", {"a": a, "b": a * 10})
    np.testing.assert_array_equal(out["out"], a * 11)
    assert host.stats["add"].calls == 1
    host.run("add", {"a": a, "b": a})
    assert host.stats["add"].calls == 2
    assert host.stats["add"].mean_ms == pytest.approx(host.stats["add"].total_ms / 2)
    assert host.stats["kvsum"].calls == 0


def test_run_before_load_and_unknown_graph():
    ex = HostExecutor([add_graph()])
    with pytest.raises(RuntimeError, match="load"):
        ex.run("add", {})
    with pytest.raises(RuntimeError, match="load"):
        ex.freeze()
    ex.load()
    with pytest.raises(GraphNotFoundError, match="no graph 'mul'.*add"):
        ex.run("mul", {})


def test_duplicate_graph_names():
    with pytest.raises(ValueError, match="duplicate graph names"):
        HostExecutor([add_graph(), add_graph()])


def test_shape_error_names_graph_and_tensor(host):
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ShapeError) as info:
        host.run("add", {"a": a, "b": np.zeros((3, 2), np.float32)})
    msg = str(info.value)
    assert "'add'" in msg and "'b'" in msg and "[2, 3]" in msg and "[3, 2]" in msg


def test_dtype_error_names_graph_and_tensor(host):
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ShapeError) as info:
        host.run("add", {"a": a.astype(np.float64), "b": a})
    msg = str(info.value)
    assert "'add'" in msg and "'a'" in msg and "float32" in msg and "float64" in msg


def test_missing_and_extra_inputs(host):
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ShapeError, match=r"missing inputs \['b'\], unexpected \[\]"):
        host.run("add", {"a": a})
    with pytest.raises(ShapeError, match=r"missing inputs \[\], unexpected \['c'\]"):
        host.run("add", {"a": a, "b": a, "c": a})


def test_resident_input_must_be_a_device_tensor(host):
    a = np.ones(4, np.float32)
    with pytest.raises(ShapeError, match="'kvsum'.*'kv' must be a device tensor"):
        host.run("kvsum", {"a": a, "kv": np.ones((2, 5), np.float32)})
    wrong = host.alloc_tensor("wrong", (5, 2), "float32")
    with pytest.raises(ShapeError, match="'kv' expects float32\\[2, 5\\]"):
        host.run("kvsum", {"a": a, "kv": wrong})
    kv = host.alloc_tensor("kv", (2, 5), "float32")
    assert isinstance(kv, DeviceTensor) and kv.shape == (2, 5) and kv.dtype == "float32"
    host.write(kv, np.s_[1, 2:4], np.array([3.0, 4.0]))
    np.testing.assert_array_equal(host.read(kv)[1], [0, 0, 3, 4, 0])
    out = host.run("kvsum", {"a": a, "kv": kv})
    np.testing.assert_array_equal(out["out"], a + 7)


def test_a_bound_graph_takes_the_host_inputs_alone(host):
    """Executor.bind checks and binds the resident inputs once; BoundGraph.run then checks the host inputs,
    returns the chosen outputs as run does, counts the call and refuses what run refuses."""
    kv = host.alloc_tensor("kv", (2, 5), "float32")
    host.write(kv, np.s_[0, :2], np.array([1.0, 2.0]))
    a = np.arange(4, dtype=np.float32)
    bound = host.bind("kvsum", {"kv": kv})
    out = bound.run({"a": a})
    np.testing.assert_array_equal(out["out"], a + 3)
    np.testing.assert_array_equal(out["out"], host.run("kvsum", {"a": a, "kv": kv})["out"])
    assert host.stats["kvsum"].calls == 2 and bound.valid
    host.write(kv, np.s_[1, 3:5], np.array([0.0, 10.0]))  # the slot is read where it is, every call
    np.testing.assert_array_equal(bound.run({"a": a})["out"], a + 13)
    assert list(host.bind("add", {}, outputs=["out"]).run({"a": a[:3].reshape(1, 3).repeat(2, 0),
                                                           "b": np.ones((2, 3), np.float32)})) == ["out"]

    with pytest.raises(ShapeError, match=r"'kvsum'.*input 'a' expects float32\[4\], got float64\[4\]"):
        bound.run({"a": a.astype(np.float64)})
    with pytest.raises(ShapeError, match=r"'kvsum'.*input 'a' expects float32\[4\], got list"):
        bound.run({"a": [0.0] * 4})
    with pytest.raises(ShapeError, match=r"takes inputs \['a'\], got \['a', 'kv'\]"):
        bound.run({"a": a, "kv": kv})
    with pytest.raises(ShapeError, match=r"'kv' must be bound to a device tensor"):
        host.bind("kvsum", {})
    with pytest.raises(ShapeError, match=r"'kv' is bound to a ndarray, not a device tensor"):
        host.bind("kvsum", {"kv": np.zeros((2, 5), np.float32)})
    with pytest.raises(ShapeError, match=r"'kv' expects float32\[2, 5\], got float32\[5, 2\]"):
        host.bind("kvsum", {"kv": host.alloc_tensor("wrong", (5, 2), "float32")})
    with pytest.raises(ShapeError, match=r"no inputs \['b'\] to bind"):
        host.bind("kvsum", {"kv": kv, "b": kv})
    with pytest.raises(ShapeError, match=r"no outputs \['logits'\]"):
        host.bind("kvsum", {"kv": kv}, outputs=["logits"])
    with pytest.raises(GraphNotFoundError, match="no graph 'mul'"):
        host.bind("mul", {})

    host.close()
    host.load()
    assert not bound.valid
    with pytest.raises(RuntimeError, match="bind it again"):
        bound.run({"a": a})


def test_graph_path():
    ex = HostExecutor([add_graph("rel", file="rel.onnx"), add_graph("abs", file="/abs/abs.onnx"),
                       add_graph("none")], graph_dir="/graphs")
    ex.load()
    assert ex.loaded_paths == ["/graphs/rel.onnx", "/abs/abs.onnx", ""]


# ------------------------------------------------------------------ static pool

def test_pool_unit():
    calls = []
    pool = StaticMemoryPool(lambda n: calls.append(n) or len(calls), lambda h: calls.append(("free", h)))
    pool.allocate("a", 10)
    pool.allocate("b", 0)
    assert calls == [10, 1]  # zero-byte buffers still get a real allocation
    assert pool.allocated_bytes == 10 and pool.num_allocations == 2
    assert pool.breakdown() == {"a": 10, "b": 0}
    with pytest.raises(ValueError, match="already allocated"):
        pool.allocate("a", 4)
    pool.freeze()
    assert pool.frozen
    with pytest.raises(PoolFrozenError, match="'c'"):
        pool.allocate("c", 4)
    pool.release_all()
    assert ("free", 1) in calls and ("free", 2) in calls
    assert pool.num_allocations == 0 and not pool.frozen


def test_allocation_after_freeze_raises(host):
    host.alloc_tensor("before", (4,), "float32")
    host.freeze()
    with pytest.raises(PoolFrozenError):
        host.alloc_tensor("after", (4,), "float32")
    with pytest.raises(PoolFrozenError):
        KVCachePool(host, 1, (1, 2, 1, 4, 2), "float32", name="late")


def test_load_is_idempotent_and_close_frees(host):
    n = host.pool.num_allocations
    host.load()
    assert host.pool.num_allocations == n
    handles = set(host.mem)
    host.close()
    assert not host.loaded
    assert set(host.freed) == handles
    assert host.device_bytes == 0


def test_group_members_share_staging_buffers():
    g1 = add_graph("small", (2, 3), group="g")
    g2 = add_graph("big", (4, 5), group="g")
    g3 = add_graph("other", (2, 3))
    ex = HostExecutor([g1, g2, g3]).load()
    assert ex.device_bytes == 3 * (4 * 5 * 4) + 3 * (2 * 3 * 4)
    assert ex.pool.num_allocations == 6
    # Both members of the group still compute correctly through the shared buffers.
    a = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(ex.run("small", {"a": a, "b": a})["out"], 2 * a)
    b = np.full((4, 5), 2, np.float32)
    np.testing.assert_array_equal(ex.run("big", {"a": b, "b": b})["out"], 2 * b)
    np.testing.assert_array_equal(ex.run("small", {"a": a, "b": 3 * a})["out"], 4 * a)


def test_device_bytes_of_a_model_graph_set():
    cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
    graphs = graph_set(cfg)
    assert len(cfg.llm.prefill_buckets) > 1
    ex = MockExecutor(graphs).load()
    expected_staging = staging_bytes(graphs)
    assert ex.device_bytes == expected_staging
    unshared = sum(s.nbytes for g in graphs for s in g.inputs + g.outputs if not s.resident)
    assert ex.device_bytes < unshared
    # Independent count for this config: H=64, V=512, T=1 tile of 224x224, 16 vision tokens.
    L, KV, Dh, H, V = 2, 2, 16, 64, 512
    P, S = 128, 1024
    by_hand = (3 * 224 * 224 * 4 + 16 * H * 4            # vision encoder
               + P * 8 + P * H * 4                     # embed group (largest bucket)
               + P * H * 4 + 8 + 8 + V * 4 + L * 2 * KV * P * Dh * 4   # prefill group
               + 8 + 8 + V * 4 + L * 2 * KV * 1 * Dh * 4)              # decode group
    assert expected_staging == by_hand
    pool = KVCachePool(ex, 3, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    assert pool.slot_bytes == L * 2 * KV * S * Dh * 4
    assert ex.device_bytes == by_hand + 3 * pool.slot_bytes
    assert ex.pool.breakdown()["prefill/new_kv"] == L * 2 * KV * P * Dh * 4


def test_steady_state_allocates_nothing():
    cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
    ex = create_executor(cfg)
    pool = KVCachePool(ex, 2, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    ex.freeze()
    n, nbytes = ex.pool.num_allocations, ex.device_bytes
    bb = LLMBackbone(cfg, ex)
    slot = pool.tensor(pool.acquire())
    ids = np.arange(40) % 250
    logits = bb.prefill(slot, 0, bb.embed(ids))
    pos = 40
    for _ in range(60):
        logits = bb.decode(slot, pos, int(np.argmax(logits)))
        pos += 1
    logits = bb.prefill(slot, pos, bb.embed(np.arange(150) % 250))  # two chunks
    assert ex.pool.num_allocations == n
    assert ex.device_bytes == nbytes
    assert ex.stats["decode_256"].calls == 60
    assert ex.stats["prefill_128"].calls == 2 and ex.stats["prefill_32"].calls == 1


# ------------------------------------------------------------------ factory

def test_factory_uses_the_config_graph_set_and_manifest(tmp_path):
    cfg = load_config(str(CONFIG_DIR / "vla_demo_orin.yaml"))
    names = [g.name for g in load_graph_metas(cfg)]
    assert names == [g.name for g in graph_set(cfg)]
    assert {"vision_encoder", "embed_96", "prefill_160", "action_expert_160"} <= set(names)
    # a flow-matching VLA reads no logits: no decode graphs, prefill returns the new cache entries alone
    assert not any(n.startswith("decode_") for n in names)
    assert [t.name for t in graph_set(cfg)[names.index("prefill_160")].outputs] == ["new_kv"]

    graphs = graph_set(cfg)

    def manifest(entries, **extra):
        (tmp_path / "manifest.json").write_text(json.dumps({"format": graphset.FORMAT, "graphs": entries, **extra}))

    manifest([g.to_dict() for g in graphs])
    with_dir = cfg.with_overrides(executor={"graph_dir": str(tmp_path)})
    assert [g.name for g in load_graph_metas(with_dir)] == names

    manifest([g.to_dict() for g in graphs[1:]])
    with pytest.raises(ConfigError, match="no graph 'vision_encoder'"):
        load_graph_metas(with_dir)

    other = graph_set(cfg.with_overrides(llm={"hidden_dim": cfg.llm.hidden_dim * 2}))
    manifest([g.to_dict() for g in other])
    with pytest.raises(ConfigError, match="other shapes"):
        load_graph_metas(with_dir)

    # one reader for every manifest: its format, missing fields and files outside the graph set are named
    (tmp_path / "manifest.json").write_text(json.dumps({"graphs": [g.to_dict() for g in graphs]}))
    with pytest.raises(graphset.GraphSetError, match="format None"):
        load_graph_metas(with_dir)
    broken = [g.to_dict() for g in graphs]
    del broken[2]["outputs"]
    manifest(broken)
    with pytest.raises(graphset.GraphSetError, match=r"graphs\[2\] \('prefill_96'\) has no field 'outputs'"):
        load_graph_metas(with_dir)
    escaping = [g.to_dict() for g in graphs]
    escaping[0]["file"] = "../elsewhere/vision_encoder.onnx"
    manifest(escaping)
    with pytest.raises(graphset.GraphSetError, match="not a file inside"):
        load_graph_metas(with_dir)
    manifest([g.to_dict() for g in graphs], tokenizer="/etc/passwd")
    with pytest.raises(graphset.GraphSetError, match="tokenizer '/etc/passwd' is not a file inside"):
        graphset.tokenizer_file(str(tmp_path), graphset.read_manifest(str(tmp_path)))


def test_factory_passes_latency_to_the_backend():
    cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml")).with_overrides(
        executor={"latency_ms": {"decode": 2.5}, "options": {"device": "NPU"}})
    ex = create_executor(cfg)
    assert ex.loaded and isinstance(ex, MockExecutor)
    assert ex.latency_ms == {"decode": 2.5}
    assert ex.options["device"] == "NPU"


# ------------------------------------------------------------------ registry

def test_unknown_backend_lists_choices():
    assert "mock" in available_backends()
    with pytest.raises(UnknownBackendError) as info:
        resolve_executor_class("mokc")
    msg = str(info.value)
    assert "unknown backend 'mokc'" in msg and "choices: mock" in msg and "did you mean 'mock'" in msg
    assert not isinstance(info.value, BackendUnavailableError)
    assert not issubclass(UnknownBackendError, BackendUnavailableError)
    assert not issubclass(BackendUnavailableError, UnknownBackendError)
    cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml")).with_overrides(executor={"backend": "trt"})
    with pytest.raises(UnknownBackendError, match=r"unknown backend 'trt' \(choices: .*tensorrt\)"):
        create_executor(cfg)


def test_backend_with_missing_package(monkeypatch):
    monkeypatch.setitem(backends.EXECUTORS, "fancy", BackendEntry(
        "synflux_ros.backends.mock.executor:MockExecutor", requires=("definitely_missing_pkg_xyz",),
        install_hint="pip install definitely_missing_pkg_xyz"))
    assert "fancy" in available_backends()
    with pytest.raises(BackendUnavailableError) as info:
        build_executor("fancy", [])
    msg = str(info.value)
    assert "'fancy'" in msg and "'definitely_missing_pkg_xyz'" in msg and "pip install" in msg
    assert isinstance(info.value, ImportError)
    assert not isinstance(info.value, UnknownBackendError)


def test_registry_resolves_modules_lazily(monkeypatch):
    monkeypatch.setitem(backends.EXECUTORS, "ghost",
                        BackendEntry("synflux_ros.backends._no_such_module_xyz:Ghost"))
    # Registering, listing and using another backend do not touch the ghost module.
    assert "ghost" in available_backends()
    ex = build_executor("mock", [add_graph()])
    assert isinstance(ex, MockExecutor)
    with pytest.raises(ModuleNotFoundError, match="_no_such_module_xyz"):
        build_executor("ghost", [])


def test_mock_module_is_imported_only_when_resolved():
    code = ("import sys, synflux_ros.backends as b\n"
            "assert 'synflux_ros.backends.mock.executor' not in sys.modules, 'imported early'\n"
            "cls = b.resolve_executor_class('mock')\n"
            "assert 'synflux_ros.backends.mock.executor' in sys.modules\n"
            "print(cls.__name__)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "MockExecutor"


def test_build_executor_returns_an_unloaded_instance():
    ex = build_executor("mock", [add_graph("a", group="x")], graph_dir="/d", options={"device": "x"})
    assert isinstance(ex, MockExecutor) and isinstance(ex, Executor)
    assert not ex.loaded and ex.graph_dir == "/d" and ex.options == {"device": "x"}
