"""The tensorrt backend's CUDA side on a real device, with only TensorRT stood in (``trt_cuda_stand_in``).

The executor runs with the real ``cuda.bindings.runtime``: its static pool is ``cudaMalloc`` memory, host
copies go through ``cudaMallocHost`` mirrors, KV appends are ``cudaMemcpy2D`` into a slot, engines are
bound by ``set_tensor_address`` at device addresses (the KV views at their byte offsets in the slot), each
graph group runs on its own non-blocking stream, and decode steps are captured and replayed as CUDA
graphs. The stand-in's engines move every input and output through those device buffers on the given
stream (see its docstring), so the numbers checked here are the executor's data path, against numpy and
the onnxruntime backend on the host.

Run with ``pytest -m gpu test/gpu`` on a machine with a CUDA device and cuda-python (see README.md);
skipped elsewhere with the reason.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
from collections import Counter

import numpy as np
import pytest

import trt_cuda_stand_in as gpu

REASON = gpu.cuda_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(REASON), reason=REASON or "a CUDA device answers")]

if not REASON:
    pytest.importorskip("onnxruntime", reason="the stand-in's engines and the reference compute with onnxruntime")
    pytest.importorskip("onnx", reason="the stand-in reads the engines' ONNX files")

import graphsets  # noqa: E402  (test/gpu)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # test/: tensorrt_stand_in
import tensorrt_stand_in  # noqa: E402

ATOL = 1e-4  # synflux-validate's fp32 threshold (the profiled llm.onnx against the per-bucket graphs)


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def device():
    dev = gpu.Device(0)
    from cuda.bindings import _version as cb_version
    drv = dev.check(dev.cudart.cudaDriverGetVersion(), "cudaDriverGetVersion")
    rtv = dev.check(dev.cudart.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
    info = {"device": dev.name, "compute_capability": f"{dev.cc[0]}.{dev.cc[1]}", "driver_cuda": drv,
            "runtime_cuda": rtv, "cuda_bindings": getattr(cb_version, "__version__", "?"), "kernel": dev.kernel_note}
    print("GPU-REPORT", json.dumps(info))
    report = os.environ.get("GPU_TEST_REPORT")
    if report:
        with open(report, "w", encoding="utf-8") as fh:
            json.dump(info, fh)
    return dev


@pytest.fixture(scope="module")
def trt(device):
    """The stand-in installed as ``tensorrt`` (cuda-python stays the real one)."""
    module = gpu.make_tensorrt(device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "tensorrt", module)
        yield module


@pytest.fixture(autouse=True)
def no_stand_in_errors(request):
    """Every test ends with no failed address check or host run in the stand-in."""
    if "device" not in request.fixturenames:
        yield
        return
    dev = request.getfixturevalue("device")
    dev.errors.clear()
    yield
    assert not dev.errors, dev.errors[:5]


def _graph_set(tmp_path_factory, device, name):
    out = graphsets.graph_set(name, str(tmp_path_factory.mktemp(name.split(".")[0])))
    if out is None:
        pytest.skip(f"no graph set for {name}: build one with `python test/gpu/graphsets.py` (needs torch) and "
                    f"carry .gpu-carry/")
    from synflux_ros.backends.tensorrt import plan
    sm = f"{device.cc[0]}.{device.cc[1]}"
    tensorrt_stand_in.write_engines(out, plan.device_tag(sm, None, "fp16"), sm=sm)
    return out


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, device):
    return _graph_set(tmp_path_factory, device, "vlm_demo.yaml")


@pytest.fixture(scope="module")
def vla(tmp_path_factory, device):
    return _graph_set(tmp_path_factory, device, "vla_demo_orin.yaml")


@pytest.fixture(scope="module")
def vla_vjp(tmp_path_factory, device):
    """π0 at demo size with Real-Time Chunking's vjp guidance: its action_expert_vjp engine too."""
    return _graph_set(tmp_path_factory, device, "vla_pi0.yaml+vjp")


@pytest.fixture(scope="module")
def vla_smolvla(tmp_path_factory, device):
    """SmolVLA at demo size: two cameras, the state as the prefill's input, cross-attention keys and values
    that the prefill writes into the cache."""
    return _graph_set(tmp_path_factory, device, "vla_smolvla.yaml")


@pytest.fixture(scope="module")
def vla_pi05_vjp(tmp_path_factory, device):
    """π0.5 at demo size (adaptive-RMSNorm expert, the state in the prompt) with the vjp guidance."""
    return _graph_set(tmp_path_factory, device, "vla_pi05.yaml+vjp")


# ---------------------------------------------------------------------------------------------- helpers

class CountingCudart:
    """The real ``cuda.bindings.runtime`` with its calls counted (set as an executor's ``cudart``), and the
    device memory, pinned memory, streams, events and graphs it creates tracked until destroyed."""

    CREATE = {"cudaMalloc": "device", "cudaMallocHost": "pinned", "cudaStreamCreateWithFlags": "stream",
              "cudaEventCreateWithFlags": "event", "cudaStreamEndCapture": "graph", "cudaGraphInstantiate": "exec"}
    DESTROY = {"cudaFree": "device", "cudaFreeHost": "pinned", "cudaStreamDestroy": "stream",
               "cudaEventDestroy": "event", "cudaGraphDestroy": "graph", "cudaGraphExecDestroy": "exec"}

    def __init__(self, real):
        self._real = real
        self.calls: Counter = Counter()
        self.live: dict[str, set] = {kind: set() for kind in self.CREATE.values()}
        self.bad_releases: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if not (name.startswith("cuda") and callable(attr) and not isinstance(attr, type)):
            return attr

        def counted(*args):
            self.calls[name] += 1
            result = attr(*args)
            ok = int(result[0]) == 0
            if name in self.CREATE and ok:
                self.live[self.CREATE[name]].add(int(result[1]))
            elif name in self.DESTROY:
                handle = int(args[0])
                if not ok or handle not in self.live[self.DESTROY[name]]:
                    self.bad_releases.append(f"{name}({handle:#x}): {result[0]!r}")
                self.live[self.DESTROY[name]].discard(handle)
            return result
        return counted

    def leaks(self) -> dict:
        return {kind: len(handles) for kind, handles in self.live.items() if handles}


def cfg_of(graphs):
    from synflux_ros.core.config import load_config
    return load_config(os.path.join(graphs, "config.yaml"))


def executor(graphs, backend="tensorrt", count=False, **options):
    """An executor of ``backend`` over ``graphs``, not loaded; with ``count`` its cudart calls are counted
    (``ex.cudart.calls``)."""
    from synflux_ros.backends import build_executor
    from synflux_ros.graphset import reader as graphset
    metas = graphset.graph_metas(graphs, graphset.read_manifest(graphs))
    ex = build_executor(backend, metas, graphs, options)
    if count:
        ex.cudart = CountingCudart(ex.cudart)
    return ex


def fill(ex, tensor, value):
    """``tensor[...] = value`` as one 2-D copy per leading index (the runtime's append path)."""
    for i in range(tensor.shape[0]):
        ex.write(tensor, (slice(i, i + 1),), value[i:i + 1])


def kv_slot(ex, name, cfg, value=None):
    t = ex.alloc_tensor(name, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    if value is not None:
        fill(ex, t, value)
    return t


def random_kv(cfg, seed):
    return (np.random.default_rng(seed).standard_normal(cfg.llm.kv_shape) * 0.5).astype(cfg.llm.kv_dtype)


def decode(ex, bound, slot, token, pos, append=True):
    out = bound.run({"input_ids": np.array([[token]], np.int64), "cache_position": np.array([pos], np.int64)})
    if append:
        ex.write(slot, np.s_[:, :, :, pos:pos + 1], out["new_kv"])
    return out


def prefill(ex, slot, cfg, ids, pos, bucket):
    """``ids`` through embed_<bucket> and prefill_<bucket> at cache position ``pos``, appended to ``slot``."""
    m = len(ids)
    padded = np.zeros((1, bucket), np.int64)
    padded[0, :m] = ids
    embeds = ex.run(f"embed_{bucket}", {"input_ids": padded})["inputs_embeds"]
    embeds[0, m:] = 0
    out = ex.run(f"prefill_{bucket}", {"inputs_embeds": embeds, "num_tokens": np.array([m], np.int64),
                                        "cache_position": np.array([pos], np.int64), "past_kv": slot})
    ex.write(slot, np.s_[:, :, :, pos:pos + m], out["new_kv"][:, :, :, :m])
    return out


def close_all(*executors):
    """Close ``executors``; one whose cudart calls were counted must have released all it created."""
    for ex in executors:
        ex.close()
    gc.collect()
    for ex in executors:
        if isinstance(getattr(ex, "cudart", None), CountingCudart):
            assert not ex.cudart.leaks() and not ex.cudart.bad_releases, (ex.cudart.leaks(), ex.cudart.bad_releases)


def same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def near(a: dict, b: dict, atol=ATOL):
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=atol, err_msg=k)


# ---------------------------------------------------------------------------------------------- tests

def test_load_allocates_from_the_pool_once_and_the_steady_state_allocates_nothing(device, trt, vlm):
    cfg = cfg_of(vlm)
    ex = executor(vlm, count=True, cuda_graphs=True)
    calls = ex.cudart.calls
    free0, _ = device.mem_info()
    try:
        ex.load()
        assert calls["cudaMalloc"] == ex.pool.num_allocations > 0
        # pinned mirrors: one per staging buffer, plus the KV-append staging
        assert calls["cudaMallocHost"] == len(ex._staging) + 1
        for a in ex.pool._allocs.values():
            assert device.memory_type(a.handle.ptr) == "device", a.name
            assert a.handle.ptr % 256 == 0, a.name
        for buf in ex._staging.values():
            assert device.memory_type(buf.host_ptr) == "host"
        slots = [kv_slot(ex, f"kv/{i}", cfg, random_kv(cfg, i)) for i in range(2)]
        assert calls["cudaMalloc"] == ex.pool.num_allocations
        ex.freeze()
        loaded = dict(calls)
        free1, _ = device.mem_info()

        bounds = [ex.bind("decode_256", {"past_kv": s}) for s in slots]
        ids = np.arange(5, 25)

        def steps(n):
            for s in slots:
                prefill(ex, s, cfg, ids, 0, 32)
            for i in range(n):
                for s, b in zip(slots, bounds):
                    decode(ex, b, s, int(ids[i % len(ids)]), len(ids) + i)
        steps(2)  # warm: first runs, one capture per slot
        free_warm, _ = device.mem_info()
        warm = dict(calls)
        steps(6)
        free_steady, _ = device.mem_info()
        for name in ("cudaMalloc", "cudaMallocHost", "cudaFree", "cudaFreeHost"):
            assert calls[name] == loaded.get(name, 0), f"{name} after freeze: {calls[name] - loaded.get(name, 0)}"
        assert warm["cudaGraphInstantiate"] == calls["cudaGraphInstantiate"] == 2  # one graph per slot
        assert calls["cudaGraphLaunch"] > warm.get("cudaGraphLaunch", 0)
        assert free_steady == free_warm, f"device memory changed in the steady state: {free_warm - free_steady}"
        from synflux_ros.core.memory import PoolFrozenError
        with pytest.raises(PoolFrozenError):
            ex.alloc_tensor("late", (4,), "float32")
        print("GPU-REPORT", json.dumps({"test": "pool", "pool_bytes": ex.pool.allocated_bytes,
                                        "pool_allocations": ex.pool.num_allocations,
                                        "free_drop_at_load": free0 - free1, "graph_warmup_bytes": free1 - free_warm}))
    finally:
        close_all(ex)


def test_host_device_round_trips(device, trt, vlm):
    ex = executor(vlm).load()
    ref = executor(vlm, "onnxruntime").load()
    try:
        rng = np.random.default_rng(1)
        # staging buffers (pinned mirrors): the bytes come back as they went
        for key, buf in ex._staging.items():
            data = rng.integers(0, 256, buf.nbytes, np.uint8)
            ex._h2d(data, buf)
            buf.host[:] = 0  # the mirror is overwritten: what comes back is the device's copy
            np.testing.assert_array_equal(ex._d2h(buf, (buf.nbytes,), "uint8"), data, err_msg=str(key))
        # caller-owned tensors (no mirror), dtypes of the contract, odd sizes
        for i, (shape, dtype) in enumerate([((3, 5, 7), "float32"), ((1000,), "float16"), ((2, 33), "int64"),
                                            ((1,), "int32")]):
            t = ex.alloc_tensor(f"t{i}", shape, dtype)
            np.testing.assert_array_equal(ex.read(t), np.zeros(shape, dtype))  # zeroed at allocation
            value = (rng.standard_normal(shape) * 100).astype(dtype)
            fill(ex, t, value)
            np.testing.assert_array_equal(ex.read(t), value)
        # a one-step graph: pixels in through staging, embeddings out, against the host
        feeds = {"pixel_values": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}
        near(ex.run("vision_encoder", feeds), ref.run("vision_encoder", feeds))
        ids = {"input_ids": rng.integers(0, cfg_of(vlm).llm.vocab_size, (1, 32)).astype(np.int64)}
        near(ex.run("embed_32", ids), ref.run("embed_32", ids))
    finally:
        close_all(ex, ref)


def test_whole_tensor_write(device, trt, vlm):
    """``write(tensor, (), value)``: what synflux-validate does to fill a cache slot (region_copy gives a
    pitch of 0 for an uncut index)."""
    cfg = cfg_of(vlm)
    ex = executor(vlm).load()
    try:
        slot = kv_slot(ex, "kv", cfg)
        value = random_kv(cfg, 3)
        ex.write(slot, (), value)
        np.testing.assert_array_equal(ex.read(slot), value)
        ex.write(slot, np.s_[:, :, :, 0:cfg.llm.max_seq_len], value * 2)  # an append spanning every row
        np.testing.assert_array_equal(ex.read(slot), value * 2)
    finally:
        close_all(ex)


def test_kv_appends_land_at_their_rows(device, trt, vlm):
    cfg = cfg_of(vlm)
    ex = executor(vlm).load()
    try:
        L, two, KV, S, Dh = cfg.llm.kv_shape
        slot = kv_slot(ex, "kv", cfg)
        want = np.zeros(cfg.llm.kv_shape, cfg.llm.kv_dtype)
        np.testing.assert_array_equal(ex.read(slot), want)
        rng = np.random.default_rng(4)
        region_host = ex._region_host.nbytes
        writes = [np.s_[:, :, :, 0:1], np.s_[:, :, :, 17:18], np.s_[:, :, :, 100:132], np.s_[:, :, :, S - 1:S],
                  np.s_[:, :, :, 200:900],  # larger than the pinned KV staging: the pageable path
                  np.s_[:, :, 1:2], (slice(1, 2),), np.s_[:, 0:1], np.s_[:, :, :, 5:6, :]]
        for index in writes:
            shape = want[index].shape
            data = rng.standard_normal(shape).astype(cfg.llm.kv_dtype)
            ex.write(slot, index, data)
            want[index] = data
            got = ex.read(slot)
            np.testing.assert_array_equal(got, want, err_msg=f"after writing {index} ({data.nbytes} bytes, pinned "
                                                              f"staging {region_host})")
        assert want[np.s_[:, :, :, 200:900]].nbytes > region_host  # the pageable path was taken
    finally:
        close_all(ex)


def test_decode_replayed_from_a_cuda_graph_matches_eager_and_host(device, trt, vlm):
    cfg = cfg_of(vlm)
    ex_g = executor(vlm, count=True, cuda_graphs=True).load()
    ex_e = executor(vlm, count=True).load()
    ref = executor(vlm, "onnxruntime").load()
    try:
        kv = random_kv(cfg, 5)
        runs = [(x, kv_slot(x, "kv", cfg, kv)) for x in (ex_g, ex_e, ref)]
        for x, _ in runs:
            x.freeze()
        bound = [(x, s, x.bind("decode_256", {"past_kv": s})) for x, s in runs]
        # the same step three times on an unchanged cache: eager (then captured), replayed, replayed
        for i in range(3):
            g, e, r = (decode(x, b, s, 7, 100, append=False) for x, s, b in bound)
            same(g, e)
            near(g, r)
        assert ex_g.cudart.calls["cudaGraphLaunch"] == 2 and ex_e.cudart.calls["cudaGraphLaunch"] == 0
        assert ex_g.cudart.calls["cudaStreamBeginCapture"] == 1
        # a decode: each step appends its new entries (the 2-D copy) and the next step's graph reads them
        rng = np.random.default_rng(6)
        for step in range(8):
            token = int(rng.integers(0, cfg.llm.vocab_size))
            g, e, r = (decode(x, b, s, token, 100 + step) for x, s, b in bound)
            same(g, e)
            near(g, r)
        assert ex_g.cudart.calls["cudaGraphLaunch"] == 10
        assert [bool(v) for v in ex_g._graphs_exec.values()] == [True]
        np.testing.assert_array_equal(ex_g.read(runs[0][1]), ex_e.read(runs[1][1]))
        np.testing.assert_allclose(ex_g.read(runs[0][1]), ref.read(runs[2][1]), rtol=0, atol=ATOL)
        # the replays ran on the device: the kernel counted every call of both engines of the route
        route = ex_g._routes["decode_256"]
        for step in route.steps:
            ctx = ex_g._contexts[(step.engine, step.profile)]
            assert ctx.host_runs == 11
            if device.kernel is not None:
                assert device.device_runs(ctx.index) == 11
    finally:
        close_all(ex_g, ex_e, ref)


def test_rebinding_another_kv_slot(device, trt, vlm):
    from synflux_ros.backends.tensorrt import plan
    cfg = cfg_of(vlm)
    ex_g = executor(vlm, count=True, cuda_graphs=True).load()
    ex_e = executor(vlm).load()
    ref = executor(vlm, "onnxruntime").load()
    try:
        kvs = [random_kv(cfg, 10), random_kv(cfg, 11)]
        slots = {x: [kv_slot(x, f"kv/{i}", cfg, kv) for i, kv in enumerate(kvs)] for x in (ex_g, ex_e, ref)}
        bound = {x: [x.bind("decode_256", {"past_kv": s}) for s in ss] for x, ss in slots.items()}
        want = [ref.run("decode_256", {"input_ids": np.array([[9]], np.int64),
                                       "cache_position": np.array([150], np.int64), "past_kv": s})
                for s in slots[ref]]
        assert not np.allclose(want[0]["logits"], want[1]["logits"])
        for turn in range(6):
            i = turn % 2
            for x in (ex_g, ex_e):
                near(decode(x, bound[x][i], slots[x][i], 9, 150, append=False), want[i])
            # unbound: the slot passed with the call
            near(ex_e.run("decode_256", {"input_ids": np.array([[9]], np.int64),
                                         "cache_position": np.array([150], np.int64), "past_kv": slots[ex_e][i]}),
                 want[i])
        assert sorted(bool(v) for v in ex_g._graphs_exec.values()) == [True, True]  # one graph per slot
        assert ex_g.cudart.calls["cudaGraphLaunch"] == 4
        # the KV views were bound at their byte offsets in each slot
        spec = ex_g.graphs["decode_256"].input("past_kv")
        llm = next(s for s in ex_g._routes["decode_256"].steps if s.engine == "llm")
        ctx = ex_g._contexts[(llm.engine, llm.profile)]
        assert len(ctx.seen) == 2  # the eager first run of each slot; the rest were replays
        for seen, slot in zip(ctx.seen, slots[ex_g]):
            for name, offset, _ in plan.kv_view_offsets(spec):
                if name in seen:
                    assert seen[name] == slot.handle.ptr + offset, name
    finally:
        close_all(ex_g, ex_e, ref)


def test_decode_that_cannot_be_captured_runs_uncaptured(device, trt, vlm):
    cfg = cfg_of(vlm)
    ex_g = executor(vlm, count=True, cuda_graphs=True).load()
    ref = executor(vlm, "onnxruntime").load()
    device.state["refuse_capture"] = True
    try:
        kv = random_kv(cfg, 12)
        pairs = [(x, kv_slot(x, "kv", cfg, kv)) for x in (ex_g, ref)]
        bound = [(x, s, x.bind("decode_256", {"past_kv": s})) for x, s in pairs]
        for step in range(5):
            g, r = (decode(x, b, s, 3 + step, 60 + step) for x, s, b in bound)
            near(g, r)
        assert ex_g.cudart.calls["cudaStreamBeginCapture"] == 1  # tried once, not again
        assert ex_g.cudart.calls["cudaGraphLaunch"] == 0
        assert list(ex_g._graphs_exec.values()) == [False]
        stream = ex_g._streams[ex_g.graphs["decode_256"].group]
        status = device.check(device.cudart.cudaStreamIsCapturing(stream), "cudaStreamIsCapturing")
        assert status == device.cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone
        assert int(device.cudart.cudaGetLastError()[0]) == 0
    finally:
        device.state["refuse_capture"] = False
        close_all(ex_g, ref)


def test_close_frees_device_memory(device, trt, vlm):
    """close() releases every buffer, pinned mirror, stream, event and CUDA graph the executor created, and
    the device's free memory comes back (a 256 MiB caller tensor makes that visible: the driver keeps the
    2 MiB pages of small allocations for reuse, so cudaMemGetInfo does not see them)."""
    cfg = cfg_of(vlm)
    big = 256 << 20

    def cycle():
        free0, _ = device.mem_info()
        ex = executor(vlm, count=True, cuda_graphs=True).load()
        slot = kv_slot(ex, "kv", cfg, random_kv(cfg, 13))
        ex.alloc_tensor("big", (big // 4,), "float32")
        ex.freeze()
        prefill(ex, slot, cfg, np.arange(3, 20), 0, 32)
        b = ex.bind("decode_256", {"past_kv": slot})
        for i in range(4):
            decode(ex, b, slot, 5 + i, 17 + i)
        live = {k: len(v) for k, v in ex.cudart.live.items()}
        pointers = [a.handle.ptr for a in ex.pool._allocs.values()]
        free1, _ = device.mem_info()
        close_all(ex)  # checks that everything created was released
        free2, _ = device.mem_info()
        assert not ex._streams and not ex._graphs_exec and not ex._contexts and ex.pool.num_allocations == 0
        assert [p for p in pointers if device.allocation(p) is not None] == []
        return {"free_before": free0, "free_loaded": free1, "free_closed": free2, "live": live}

    first = cycle()
    second = cycle()
    print("GPU-REPORT", json.dumps({"test": "close", "first": first, "second": second}))
    for c in (first, second):
        assert c["live"]["device"] > 10 and c["live"]["stream"] >= 4 and c["live"]["exec"] == 1, c["live"]
        assert c["free_before"] - c["free_loaded"] >= big
        assert c["free_closed"] >= c["free_before"] - (2 << 20), c


def test_zeroed_tensors_read_as_zeros_on_the_executors_streams(device, trt, vlm):
    """alloc_tensor(zero=True) (a KV slot) must be zero for a graph run right after it. A 1 GiB tensor makes
    the memset long enough to see whether the executor's stream waits for it."""
    ex = executor(vlm).load()
    try:
        n = 1 << 30
        t = ex.alloc_tensor("big", (n // 4,), "float32", zero=False)
        rt, host = device.cudart, ex._region_host
        stream = ex._streams[ex.graphs["decode_256"].group]
        stale = 0
        for _ in range(5):
            device.check(rt.cudaMemset(t.handle.ptr, 0xFF, n), "cudaMemset")
            device.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            ex._zero_device(t.handle, t.shape, t.dtype)  # what alloc_tensor(zero=True) does
            device.check(rt.cudaMemcpyAsync(host.host_ptr, t.handle.ptr + n - 4096, 4096,
                                            rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync")
            device.check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            stale += bool(host.host[:4096].any())
        assert stale == 0, f"{stale} of 5 reads on the executor's stream saw the tensor before it was zeroed"
    finally:
        close_all(ex)


def test_stages_run_concurrently_on_their_streams(device, trt, vlm):
    """Decode (captured) in one thread while the vision encoder, embed and prefill run in another, as the
    pipeline's stages do: each thread's results are those of the host."""
    cfg = cfg_of(vlm)
    ex = executor(vlm, cuda_graphs=True).load()
    ref = executor(vlm, "onnxruntime").load()
    try:
        kv = random_kv(cfg, 20)
        slots = {x: [kv_slot(x, f"kv/{i}", cfg, kv) for i in range(2)] for x in (ex, ref)}
        rng = np.random.default_rng(21)
        tokens = rng.integers(0, cfg.llm.vocab_size, 24)
        pixels = [rng.standard_normal((1, 3, 224, 224)).astype(np.float32) for _ in range(4)]
        prompts = [rng.integers(0, cfg.llm.vocab_size, 20) for _ in range(4)]

        def decoder(x):
            b = x.bind("decode_256", {"past_kv": slots[x][0]})
            return [decode(x, b, slots[x][0], int(t), 200 + i)["logits"] for i, t in enumerate(tokens)]

        def encoder(x):
            out = []
            for i, (p, ids) in enumerate(zip(pixels, prompts)):
                out.append(x.run("vision_encoder", {"pixel_values": p})["vision_embeds"])
                out.append(prefill(x, slots[x][1], cfg, ids, 40 * i, 32)["logits"])
            return out

        want = {"decoder": decoder(ref), "encoder": encoder(ref)}
        got, errors = {}, []

        def worker(name, fn):
            try:
                got[name] = fn(ex)
            except BaseException as exc:  # noqa: BLE001
                errors.append(f"{name}: {exc!r}")
        threads = [threading.Thread(target=worker, args=(n, f)) for n, f in (("decoder", decoder),
                                                                            ("encoder", encoder))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for name in want:
            assert len(got[name]) == len(want[name])
            for a, b in zip(got[name], want[name]):
                np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=name)
        assert any(ex._graphs_exec.values())
        np.testing.assert_allclose(ex.read(slots[ex][0]), ref.read(slots[ref][0]), rtol=0, atol=ATOL)
        np.testing.assert_allclose(ex.read(slots[ex][1]), ref.read(slots[ref][1]), rtol=0, atol=ATOL)
    finally:
        close_all(ex, ref)


@pytest.mark.parametrize("which", ["vlm", "vla", "vla_vjp", "vla_smolvla", "vla_pi05_vjp"])
def test_synflux_validate_against_onnxruntime(device, trt, request, which):
    """``synflux-validate --backend tensorrt`` (every graph, then the whole model) with CUDA graphs on."""
    from synflux_ros.buildtool.validate import validate
    graphs = request.getfixturevalue(which)
    rows = validate(graphs, "tensorrt", options={"cuda_graphs": True})
    failed = [f"{r.check}: diff {r.max_abs_diff:.3g} cos {r.cosine:.6f} {r.detail}" for r in rows if not r.passed]
    assert rows and not failed, failed
    if which.endswith("_vjp"):  # the vjp engine's route ran: velocity and correction of each span
        assert sum(r.check.startswith("action_expert_vjp_") for r in rows) == 4, [r.check for r in rows]
