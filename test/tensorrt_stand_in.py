"""A stand-in for TensorRT's runtime and cuda-python's ``runtime`` module, for testing the tensorrt backend's
bookkeeping on a machine without an NVIDIA GPU.

"Device" memory is host memory (``cudaMalloc`` hands out addresses of numpy buffers; copies are
``memmove``); an "engine" is the ONNX file its sidecar entry names, run by onnxruntime at the shapes of
the context's optimization profile, reading every input from and writing every output to the address
bound with ``set_tensor_address``. Stream capture records the enqueued runs and ``cudaGraphLaunch``
replays them. What this checks: the executor's routes, profile selection, view offsets, 2-D KV copies,
pinned staging, rebinding and CUDA-graph replay. What it cannot check: TensorRT itself.
"""
from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import json
import types

import numpy as np

VERSION = "10.3.0"
SM = (8, 7)


# ---------------------------------------------------------------------------------------------- cudart

class _Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


class _Handle:
    def __init__(self, n: int):
        self.n = n

    def __int__(self):
        return self.n


def make_cudart():
    cu = types.ModuleType("cuda.bindings.runtime")
    cu.__spec__ = importlib.machinery.ModuleSpec("cuda.bindings.runtime", None)
    mem: dict[int, np.ndarray] = {}
    state = {"handles": 100, "capturing": {}, "graphs": {}, "launches": 0}
    cu.state, cu.memory = state, mem

    cu.cudaDeviceAttr = types.SimpleNamespace(cudaDevAttrComputeCapabilityMajor=75,
                                              cudaDevAttrComputeCapabilityMinor=76)
    cu.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2)
    cu.cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)
    cu.cudaStreamNonBlocking, cu.cudaEventDisableTiming = 1, 2
    ok = _Err.cudaSuccess

    def handle():
        state["handles"] += 1
        return _Handle(state["handles"])

    def malloc(n):
        buf = np.zeros(int(n) + 64, np.uint8)
        ptr = buf.ctypes.data + (-buf.ctypes.data) % 64
        mem[ptr] = buf
        return ok, ptr

    cu.cudaMalloc = cu.cudaMallocHost = malloc
    cu.cudaFree = cu.cudaFreeHost = lambda ptr: (ok,) if mem.pop(int(ptr), None) is not None else (_Err(1),)
    cu.cudaSetDevice = lambda d: (ok,) if d == 0 else (_Err(1),)
    cu.cudaDeviceGetAttribute = lambda attr, dev: (ok, SM[0] if attr == 75 else SM[1])
    cu.cudaGetErrorName = lambda err: (ok, _Err(int(err)).name.encode())
    cu.cudaMemset = lambda ptr, v, n: (ctypes.memset(int(ptr), v, int(n)), (ok,))[1]
    cu.cudaMemcpy = lambda dst, src, n, kind: (ctypes.memmove(int(dst), int(src), int(n)), (ok,))[1]

    def memcpy_2d(dst, dpitch, src, spitch, width, height, kind):
        for row in range(int(height)):
            ctypes.memmove(int(dst) + row * int(dpitch), int(src) + row * int(spitch), int(width))
        return (ok,)

    cu.cudaMemcpy2D = memcpy_2d
    cu.cudaStreamCreateWithFlags = lambda flags: (ok, handle())
    cu.cudaEventCreateWithFlags = lambda flags: (ok, handle())
    for name in ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaStreamDestroy", "cudaEventDestroy",
                 "cudaGraphExecDestroy"):
        setattr(cu, name, lambda *a: (ok,))
    cu.cudaEventRecord = lambda event, stream: (ok,)

    def begin_capture(stream, mode):
        state["capturing"][int(stream)] = []
        return (ok,)

    def end_capture(stream):
        graph = handle()
        state["graphs"][int(graph)] = state["capturing"].pop(int(stream))
        return ok, graph

    def launch(graph_exec, stream):
        state["launches"] += 1
        for run in state["graphs"][int(graph_exec)]:
            run()
        return (ok,)

    cu.cudaStreamBeginCapture, cu.cudaStreamEndCapture = begin_capture, end_capture
    def instantiate(graph, flags):
        exec_graph = handle()
        state["graphs"][int(exec_graph)] = list(state["graphs"][int(graph)])
        return ok, exec_graph

    def destroy_graph(graph):
        state["graphs"].pop(int(graph))
        return (ok,)

    cu.cudaGraphInstantiate, cu.cudaGraphDestroy = instantiate, destroy_graph
    cu.cudaDeviceSynchronize = cu.cudaGetLastError = lambda: (ok,)
    cu.cudaGraphLaunch = launch
    return cu


# ---------------------------------------------------------------------------------------------- tensorrt

def make_tensorrt(cudart):
    import onnx
    import onnxruntime as ort

    trt = types.ModuleType("tensorrt")
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    trt.__version__ = VERSION
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    trt.ExecutionContextAllocationStrategy = types.SimpleNamespace(USER_MANAGED="USER_MANAGED")

    class Logger:
        WARNING = 2

        def __init__(self, severity=2):
            self.severity = severity

    ORT_DTYPE = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
                 "tensor(int32)": np.int32}

    class Engine:
        def __init__(self, desc):
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            self.session = ort.InferenceSession(desc["onnx"], so, providers=["CPUExecutionProvider"])
            self.profiles = desc["profiles"]  # [{input: shape}]
            # TensorRT may leave a network input that no layer reads out of the engine (a flow-matching VLA's
            # llm graph does not read the last layer's past_kv views): the stand-in leaves it out, so a
            # runtime that binds it anyway fails here
            read = {name for node in onnx.load(desc["onnx"], load_external_data=False).graph.node for name in node.input}
            self.unread = {i.name: i for i in self.session.get_inputs() if i.name not in read}
            self.inputs = {i.name: i for i in self.session.get_inputs() if i.name in read}
            self.outputs = {o.name: o for o in self.session.get_outputs()}
            self.names = list(self.inputs) + list(self.outputs)
            self.num_optimization_profiles = max(len(self.profiles), 1)
            self.contexts = []

        num_io_tensors = property(lambda self: len(self.names))

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name in self.inputs else trt.TensorIOMode.OUTPUT

        def get_tensor_shape(self, name):
            port = self.inputs.get(name) or self.outputs[name]
            return tuple(d if isinstance(d, int) else -1 for d in port.shape)

        def get_tensor_profile_shape(self, name, profile):
            shape = tuple(self.profiles[profile][name])
            return shape, shape, shape

        def get_device_memory_size_for_profile_v2(self, profile):
            return 1024 * (profile + 1)

        def create_execution_context(self, strategy):
            assert strategy == "USER_MANAGED"
            ctx = Context(self)
            self.contexts.append(ctx)
            return ctx

    class Context:
        def __init__(self, engine):
            self.engine, self.addresses, self.shapes, self.profile, self.memory = engine, {}, {}, 0, None
            self.runs = 0

        def set_device_memory(self, ptr, size):
            self.memory = (ptr, size)

        def set_optimization_profile_async(self, profile, stream):
            self.profile = profile
            return True

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, ptr):
            if name not in self.engine.names:
                return False
            self.addresses[name] = int(ptr)
            return True

        def _shape(self, port, name):
            if name in self.shapes:
                return self.shapes[name]
            return tuple(port.shape)

        def _array(self, name, shape, dtype):
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            raw = (ctypes.c_uint8 * max(n, 1)).from_address(self.addresses[name])
            return np.frombuffer(raw, np.uint8, n).view(dtype).reshape(shape)

        def _run(self):
            assert self.memory is not None, "activation memory was not supplied"
            feeds = {n: self._array(n, self._shape(p, n), ORT_DTYPE[p.type]).copy()
                     for n, p in self.engine.inputs.items()}
            feeds.update({n: np.zeros(p.shape, ORT_DTYPE[p.type]) for n, p in self.engine.unread.items()})
            outs = self.engine.session.run(None, feeds)
            for (name, port), value in zip(self.engine.outputs.items(), outs):
                self._array(name, value.shape, ORT_DTYPE[port.type])[...] = value
            self.runs += 1

        def execute_async_v3(self, stream):
            missing = set(self.engine.names) - set(self.addresses)
            assert not missing, f"unbound tensors {missing}"
            capture = cudart.state["capturing"].get(int(stream))
            if capture is not None and cudart.state.get("refuse_capture"):
                return False  # an engine with operations that cannot be captured
            if capture is not None:
                capture.append(self._run)
            else:
                self._run()
            return True

    class Runtime:
        def __init__(self, logger):
            self.DLA_core = -1

        def deserialize_cuda_engine(self, blob):
            try:
                desc = json.loads(bytes(blob))
            except ValueError:
                return None
            return Engine(desc)

    trt.Logger, trt.Runtime = Logger, Runtime
    return trt


def write_engines(graph_dir: str, tag: str, dla_kinds=(), version: str = VERSION, sm: str = "8.7") -> str:
    """Engines of the stand-in for the graph set in ``graph_dir`` (as ``synflux-build --backend tensorrt``
    would lay them out): each engine file names its ONNX and its profiles' shapes."""
    import os

    from synflux_ros.backends.tensorrt import plan
    from synflux_ros.graphset import reader as graphset
    manifest = graphset.read_manifest(graph_dir)
    metas = graphset.graph_metas(graph_dir, manifest)
    out = os.path.join(graph_dir, "tensorrt", tag)
    os.makedirs(out, exist_ok=True)
    engines = {}
    for spec in plan.plan_engines(metas, dla_kinds):
        desc = {"onnx": os.path.join(graph_dir, spec.onnx), "profiles": [dict(p.shapes) for p in spec.profiles]}
        blob = json.dumps(desc).encode()
        with open(os.path.join(out, f"{spec.name}.engine"), "wb") as fh:
            fh.write(blob)
        engines[spec.name] = {"file": f"{spec.name}.engine", "profiles": [p.graph for p in spec.profiles],
                              "kind": spec.kind, "dla": spec.dla, "bytes": len(blob), "onnx": spec.onnx}
    side = {"format": plan.FORMAT, "tensorrt": version, "module": "tensorrt", "sm": sm, "dla_core": None,
            "precision": "fp16", "flags": {}, "engines": engines,
            "graph_keys": {g["name"]: g.get("key", "") for g in manifest["graphs"]}}
    with open(os.path.join(out, plan.SIDECAR), "w", encoding="utf-8") as fh:
        json.dump(side, fh)
    return out
