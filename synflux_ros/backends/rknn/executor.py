"""Rockchip NPU executor (``executor: rknn``): runs the ``.rknn`` graphs that ``synflux-build --backend rknn
--target <soc>`` compiled beside a graph set (:mod:`synflux_ros.backends.rknn.build`).

Two runtimes behind the same hooks: on a board (aarch64 with rknn-toolkit-lite2) each graph runs on the NPU
with ``RKNNLite`` in this process; elsewhere rknn-toolkit2's simulator runs it in a worker process under the
toolkit's own venv (``worker.py``), reading and writing the executor's shared-memory buffers in place. A set
compiled for another target, by another toolkit or from older ONNX graphs is refused with the rebuild command.
How and why: docs/backends/rknn.md; the options: :mod:`synflux_ros.backends.rknn.options`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import select
import subprocess
import sys
import tempfile
import threading
import weakref

import numpy as np

from ...graphset import reader as graphset
from ...core.config import ConfigError, choices_hint
from ...core.executor import Executor, ShapeError
from ...core.contract import GraphMeta
from ...graphset.reader import GraphSetError, GraphSetNotFoundError
from .. import BackendUnavailableError
from ..binding import HostBuffer, HostBufferHooks
from ..options import parse_options
from . import sidecar
from .options import CORE_MASKS, RKNNExecutorOptions

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def rebuild_command(graph_dir: str, target: str, quantize: str = "fp16") -> str:
    return (f"synflux-build --config <model.yaml> --out {graph_dir or '<graph_dir>'} --backend rknn "
            f"--target {target or '<soc>'}" + ("" if quantize in ("", "fp16") else f" --quantize {quantize}"))


def default_simulator_pythons() -> list[str]:
    """Where ``make rknn-venv`` puts the toolkit's Python: beside the venv this package runs from, then
    beside the source tree this file is in."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(os.path.dirname(os.path.abspath(sys.prefix)), ".venv-rknn", "bin", "python"),
                  os.path.join(os.path.dirname(os.path.dirname(here)), ".venv-rknn", "bin", "python")]
    return list(dict.fromkeys(candidates))


def board_runtime_available() -> bool:
    """An RKNN board: aarch64 with rknn-toolkit-lite2 (``rknnlite``) installed."""
    return platform.machine().lower() in ("aarch64", "arm64") and importlib.util.find_spec("rknnlite") is not None


def board_soc() -> str:
    """The Rockchip SoC of this board from the device tree (``rockchip,rk3588``), or ''."""
    for path in ("/proc/device-tree/compatible", "/sys/firmware/devicetree/base/compatible"):
        try:
            with open(path, "rb") as fh:
                entries = fh.read().decode("ascii", "replace").split("\0")
        except OSError:
            continue
        for entry in entries:
            vendor, _, soc = entry.partition(",")
            if vendor == "rockchip" and soc.startswith("rk"):
                return soc
    return ""


# ---------------------------------------------------------------------------------------------- buffers
class ShmBuffer(HostBuffer):
    """Simulator device buffer: a POSIX shared-memory segment (zero-filled) that the worker maps once; on a
    board a device buffer is a plain :class:`~synflux_ros.backends.binding.HostBuffer` (the NPU runtime copies
    in and out)."""

    __slots__ = ("shm", "id", "nbytes")

    def __init__(self, nbytes: int, buf_id: int):
        from multiprocessing import shared_memory

        self.shm = shared_memory.SharedMemory(create=True, size=max(int(nbytes), 1))
        self.id = buf_id
        self.nbytes = max(int(nbytes), 1)
        self.array = np.ndarray((int(nbytes),), np.uint8, buffer=self.shm.buf)
        self.ptr = self.array.ctypes.data

    @property
    def name(self) -> str:
        return self.shm.name

    def release(self) -> None:
        self.array = None
        try:
            self.shm.close()
        except BufferError:  # a view is still referenced; the mapping goes with it
            pass
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------------- simulator
def toolkit_env() -> dict:
    """The environment for the toolkit's Python: without this venv's library path (ROS wheels) and without
    PYTHONPATH/PYTHONHOME, which would mix another interpreter's packages into the toolkit's venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    prefix = os.path.abspath(sys.prefix) + os.sep
    if env.get("LD_LIBRARY_PATH"):
        kept = [p for p in env["LD_LIBRARY_PATH"].split(os.pathsep) if p and not os.path.abspath(p).startswith(prefix)]
        if kept:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
        else:
            del env["LD_LIBRARY_PATH"]
    return env


class SimulatorWorker:
    """The worker process and its two pipes; one request at a time."""

    def __init__(self, python: str):
        fd, self.log_path = tempfile.mkstemp(prefix="synflux-rknn-worker-", suffix=".log")
        self._lock = threading.Lock()
        self.failed = False
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        self._cwd = tempfile.mkdtemp(prefix="synflux-rknn-worker-")
        try:
            self.proc = subprocess.Popen(
                [python, WORKER, "--requests", str(req_r), "--replies", str(rep_w), "--log", self.log_path],
                stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT, pass_fds=(req_r, rep_w),
                cwd=self._cwd, env=toolkit_env())
        except OSError as exc:
            for f in (req_w, rep_r):
                os.close(f)
            os.remove(self.log_path)
            os.rmdir(self._cwd)
            raise BackendUnavailableError(f"rknn executor: cannot start the simulator worker with {python}: {exc}; "
                                          f"run `make rknn-venv`") from exc
        finally:
            for f in (req_r, rep_w, fd):  # the worker's ends and its log are the child's now
                os.close(f)
        self._requests = os.fdopen(req_w, "w", encoding="utf-8", buffering=1)
        self._replies = os.fdopen(rep_r, "r", encoding="utf-8")
        self._finalizer = weakref.finalize(self, SimulatorWorker._stop, self.proc, self._requests, self._replies)
        hello = self._receive()
        if not hello.get("ok"):
            self.close()
            raise BackendUnavailableError(f"rknn executor: the simulator worker ({python}) failed to start: "
                                          f"{hello.get('error')}; run `make rknn-venv`")
        self.toolkit = str(hello.get("toolkit", ""))

    def _receive(self) -> dict:
        fd = self._replies.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                line = self._replies.readline()
                if line:
                    return json.loads(line)
            if ready or self.proc.poll() is not None:
                self.failed = True
                code = self.proc.wait()
                raise RuntimeError(f"rknn executor: the simulator worker exited (code {code}); last lines of its "
                                   f"log {self.log_path}:\n{self.log_tail()}")

    def request(self, msg: dict) -> dict:
        with self._lock:
            if self.proc.poll() is not None:
                self.failed = True
                raise RuntimeError(f"rknn executor: the simulator worker is gone (code {self.proc.returncode}); "
                                   f"log: {self.log_path}")
            try:
                self._requests.write(json.dumps(msg) + "\n")
            except (BrokenPipeError, ValueError) as exc:
                self.failed = True
                raise RuntimeError(f"rknn executor: the simulator worker is gone ({exc}); log: {self.log_path}") from exc
            reply = self._receive()
        if not reply.get("ok"):
            self.failed = True
        return reply

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""

    @staticmethod
    def _stop(proc, requests, replies) -> None:
        try:
            if proc.poll() is None:
                try:
                    requests.write(json.dumps({"op": "close"}) + "\n")
                    requests.flush()
                except (BrokenPipeError, ValueError, OSError):
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            for f in (requests, replies):
                try:
                    f.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._finalizer()
        if not self.failed:
            try:
                os.remove(self.log_path)
            except OSError:
                pass
        try:
            os.rmdir(self._cwd)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------- executor
class _Graph:
    __slots__ = ("name", "rknn", "plan", "formats", "entry")

    def __init__(self, name, rknn, plan, entry):
        self.name = name
        self.rknn = rknn  # RKNNLite on a board, None in the simulator (the worker holds the model)
        self.plan = plan  # [(onnx input name, contract input index, byte offset, shape, dtype)]
        self.formats = ["nchw"] * len(plan)
        self.entry = entry


def input_plan(meta: GraphMeta) -> list[tuple[str, int, int, tuple, str]]:
    """The model inputs in the order the graph was compiled with: the contract's, each of
    ``graphset.VIEW_INPUTS`` as its views at their byte offsets in the contract input's buffer."""
    plan = []
    for index, spec in enumerate(meta.inputs):
        lead = graphset.VIEW_INPUTS.get(spec.name, 0)
        if not lead:
            plan.append((spec.name, index, 0, tuple(spec.shape), spec.dtype))
            continue
        size = np.dtype(spec.dtype).itemsize
        for idx in graphset.view_indices(spec.shape, lead):
            name = graphset.view_name(spec.name, idx)
            offset, shape = graphset.input_views(spec.name, spec.shape, size, name)
            plan.append((name, index, offset, tuple(shape), spec.dtype))
    return plan


class RKNNExecutor(graphset.ChecksWeightFormat, HostBufferHooks, Executor):
    """Runs a graph set compiled by ``synflux-build --backend rknn`` on a Rockchip NPU (RKNNLite) or in
    rknn-toolkit2's simulator behind a worker process (see docs/backends/rknn.md)."""

    name = "rknn"
    options_type = RKNNExecutorOptions

    def __init__(self, graphs, graph_dir: str = "", options: dict | None = None):
        super().__init__(graphs, graph_dir, options)
        opts = self.opts = parse_options(self.options_type, options, self.name)
        runtime = opts.runtime
        if runtime == "auto":
            runtime = "board" if board_runtime_available() else "simulator"
        self.runtime = runtime
        self.core_mask = str(opts.core_mask)
        if self.core_mask not in CORE_MASKS:
            raise ConfigError(f"rknn executor: executor.options.core_mask: {opts.core_mask!r} is not allowed"
                              f"{choices_hint(self.core_mask, CORE_MASKS)}")
        self.check_toolkit_version = opts.check_toolkit_version
        self.target = opts.target
        self.simulator_python = ""
        if self.runtime == "simulator":
            self.simulator_python = self._find_simulator_python(opts.simulator_python)
        elif importlib.util.find_spec("rknnlite") is None:
            raise BackendUnavailableError(
                "rknn executor: runtime 'board' needs rknn-toolkit-lite2 (module rknnlite) and librknnrt.so: "
                "pip install the rknn_toolkit_lite2 wheel of your toolkit version on the board")
        self.toolkit = ""
        self._sidecar: sidecar.Sidecar | None = None
        self._sidecar_path = ""
        self._onnx_keys: dict[str, str] = {}
        self._worker: SimulatorWorker | None = None
        self._next_id = 0
        self._mapped: set[int] = set()

    @staticmethod
    def _find_simulator_python(explicit) -> str:
        if explicit:
            if not isinstance(explicit, str) or not os.path.isfile(explicit):
                raise BackendUnavailableError(f"rknn executor: simulator_python {explicit!r} does not exist; "
                                              f"run `make rknn-venv` to create .venv-rknn")
            return explicit
        for path in default_simulator_pythons():
            if os.path.isfile(path):
                return path
        raise BackendUnavailableError(
            f"rknn executor: no NPU runtime here (rknnlite runs on aarch64 boards only) and no rknn-toolkit2 "
            f"simulator venv at {' or '.join(default_simulator_pythons())}: run `make rknn-venv` (or set "
            f"executor.options.simulator_python)")

    def device_of(self, graph: str) -> str:
        target = self.target or "?"
        return f"rknn:{target}" if self.runtime == "board" else f"rknn:{target}-simulator"

    # ------------------------------------------------------------------ graph set
    def load(self) -> "RKNNExecutor":
        if self._loaded:
            return self
        try:
            self.check_weight_format()
            self._open_graph_set()
            if self.runtime == "simulator":
                self._worker = SimulatorWorker(self.simulator_python)
                self.toolkit = self._worker.toolkit
                self._check_toolkit(self.toolkit, exact=True)
            else:
                self.toolkit = self._board_toolkit_version()
                if self.check_toolkit_version and self.toolkit:
                    self._check_toolkit(self.toolkit, exact=False)
            super().load()
        except BaseException:
            self.close()
            raise
        return self

    def _open_graph_set(self) -> None:
        gdir = self.graph_dir
        manifest = graphset.read_manifest(gdir)
        self._onnx_keys = {g["name"]: str(g.get("key", "")) for g in manifest["graphs"]}
        root = os.path.join(gdir, sidecar.ROOT)
        have = sidecar.compiled_targets(gdir)
        target = self.target
        if not target:
            if self.runtime == "board":
                target = board_soc()
                if not target:
                    raise ValueError("rknn executor: cannot read the SoC from the device tree; set "
                                     "executor.options.target (e.g. rk3588)")
            elif len(have) == 1:
                target = have[0]
            elif have:
                raise ValueError(f"rknn executor: {gdir} is compiled for several targets ({', '.join(have)}); "
                                 f"choose one with executor.options.target")
            else:
                raise GraphSetNotFoundError(f"rknn executor: {gdir} has no RKNN graphs ({root} is empty or missing); "
                                            f"compile them with: {rebuild_command(gdir, 'rk3588')}")
        self.target = target
        path = sidecar.sidecar_path(gdir, target)
        self._sidecar_path = path
        try:
            self._sidecar = sidecar.read(gdir, target)
        except FileNotFoundError:
            other = f" (it has: {', '.join(have)})" if have else ""
            raise GraphSetNotFoundError(f"rknn executor: {path} not found: {gdir} was not compiled for {target}"
                                        f"{other}; compile it with: {rebuild_command(gdir, target)}") from None
        except sidecar.SidecarError as exc:
            raise GraphSetError(f"rknn executor: {path}: {exc}; rebuild: {rebuild_command(gdir, target)}") from None

    def _check_toolkit(self, version: str, exact: bool) -> None:
        built = self._sidecar.toolkit
        same = built == version if exact else built.split(".")[:2] == version.split(".")[:2]
        if not same:
            what = "rknn-toolkit2 (simulator)" if exact else "rknn-toolkit-lite2"
            raise GraphSetError(
                f"rknn executor: {self._sidecar_path}: the graphs were compiled by rknn-toolkit2 {built or '?'}, this "
                f"machine has {what} {version}; recompile them with: "
                f"{rebuild_command(self.graph_dir, self.target)}" + ("" if exact else
                                                                     " (or set check_toolkit_version: false)"))

    @staticmethod
    def _board_toolkit_version() -> str:
        from importlib import metadata

        for dist in ("rknn-toolkit-lite2", "rknn_toolkit_lite2"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return ""

    # ------------------------------------------------------------------ the five hooks
    def _load_graph(self, path: str, meta: GraphMeta) -> object:
        gdir, target = self.graph_dir, self.target
        entry = self._sidecar.graphs.get(meta.name)
        rebuild = rebuild_command(gdir, target, self._sidecar.quantize)
        if entry is None:
            raise GraphSetNotFoundError(f"rknn executor: {self._sidecar_path} has no graph {meta.name!r}; compile "
                                        f"it with: {rebuild}")
        tdir = os.path.dirname(self._sidecar_path)
        rknn_file = graphset.member_path(tdir, entry.file, f"graph {meta.name!r} .rknn file")
        if not os.path.isfile(rknn_file):
            raise GraphSetNotFoundError(f"rknn executor: graph {meta.name!r}: {rknn_file} not found; {rebuild}")
        if entry.onnx_key != self._onnx_keys.get(meta.name):
            raise GraphSetError(f"rknn executor: {rknn_file} was compiled from another version of "
                                f"{meta.name}.onnx (the graph set was rebuilt since); recompile it with: {rebuild}")
        dtype = entry.dtype
        if dtype not in sidecar.DTYPES:
            raise GraphSetError(f"rknn executor: {self._sidecar_path}: graph {meta.name!r} has dtype {dtype!r} "
                                f"({', '.join(sidecar.DTYPES)} are supported); recompile it with: {rebuild}")
        compiled = list(entry.inputs)
        contract, fed = input_plan(meta), {n for n, _ in compiled}
        # a cache view that nothing in the graph reads was left out at compile time (build.rknn.prepare_source)
        plan = [p for p in contract if p[0] in fed or not graphset.VIEW_INPUTS.get(meta.inputs[p[1]].name)]
        if compiled != [(n, shape) for n, _, _, shape, _ in plan] or \
                list(entry.outputs) != [t.name for t in meta.outputs]:
            raise ShapeError(f"rknn executor: {rknn_file} was compiled with inputs {compiled} and outputs "
                             f"{list(entry.outputs)}, the graph contract has {[(p[0], p[3]) for p in contract]} and "
                             f"{[t.name for t in meta.outputs]}; recompile it with: {rebuild}")
        if self.runtime == "board":
            return _Graph(meta.name, self._load_board(rknn_file, meta), plan, entry)
        source = graphset.member_path(gdir, entry.source, f"graph {meta.name!r} RKNN source")
        if not os.path.isfile(source):
            raise GraphSetNotFoundError(f"rknn executor: graph {meta.name!r}: {source} (the ONNX file {rknn_file} "
                                        f"was compiled from, which the simulator builds again) not found; {rebuild}")
        quantize = None
        if dtype == "int8":
            q = entry.quantization or sidecar.Quantization()
            dataset = graphset.member_path(tdir, q.dataset, f"graph {meta.name!r} calibration set") \
                if q.dataset else os.path.join(tdir, "calib", meta.name, "dataset.txt")
            if not q.dataset or not os.path.isfile(dataset):
                raise GraphSetNotFoundError(
                    f"rknn executor: graph {meta.name!r} is int8 and the simulator quantizes it again on its "
                    f"calibration set, but {dataset} is missing; {rebuild}")
            quantize = {"dtype": q.dtype, "algorithm": q.algorithm, "method": q.method,
                        "dataset": os.path.abspath(dataset)}
        reply = self._worker.request({
            "op": "load", "graph": meta.name, "onnx": os.path.abspath(source), "target": target,
            "inputs": [[n, list(shape), dt, index, offset] for n, index, offset, shape, dt in plan],
            "outputs": [[t.name, list(t.shape), t.dtype] for t in meta.outputs], "quantize": quantize})
        if not reply.get("ok"):
            said = "; ".join(reply.get("messages") or [])
            raise RuntimeError(f"rknn executor: the simulator cannot build graph {meta.name!r} ({dtype}) from {source} "
                               f"for {target}: {reply.get('error')}" + (f"; the toolkit says: {said}" if said else "")
                               + f" (log: {self._worker.log_path})")
        return _Graph(meta.name, None, plan, entry)

    def _load_board(self, rknn_file: str, meta: GraphMeta):
        from rknnlite.api import RKNNLite

        lite = RKNNLite(verbose=False)
        if lite.load_rknn(rknn_file) != 0:
            raise RuntimeError(f"rknn executor: RKNNLite cannot load graph {meta.name!r} from {rknn_file}; "
                               f"recompile it with: {rebuild_command(self.graph_dir, self.target)}")
        mask = getattr(RKNNLite, CORE_MASKS[self.core_mask], 0)
        if lite.init_runtime(core_mask=mask) != 0:
            lite.release()
            raise RuntimeError(f"rknn executor: RKNNLite init_runtime failed for graph {meta.name!r} ({rknn_file}, "
                               f"target {self.target}, core_mask {self.core_mask}): is librknnrt.so installed and "
                               f"the NPU driver loaded? Was the graph compiled for this SoC?")
        return lite

    def _execute(self, graph_handle, device_inputs, device_outputs, meta: GraphMeta) -> None:
        g: _Graph = graph_handle
        if g.rknn is None:
            self._execute_simulator(g, device_inputs, device_outputs, meta)
            return
        bufs = [device_inputs[spec.name] for spec in meta.inputs]
        feeds = [bufs[index].view(shape, dtype, offset) for _, index, offset, shape, dtype in g.plan]
        outs = g.rknn.inference(inputs=feeds, data_format=g.formats)
        if outs is None or len(outs) != len(meta.outputs):
            raise RuntimeError(f"rknn executor: graph {meta.name!r}: RKNNLite.inference returned "
                               f"{None if outs is None else len(outs)} outputs, expected {len(meta.outputs)}")
        for spec, value in zip(meta.outputs, outs):
            value = np.asarray(value)
            if value.size != int(np.prod(spec.shape, dtype=np.int64)):
                raise ShapeError(f"rknn executor: graph {meta.name!r} output {spec.name!r} has {value.size} elements, "
                                 f"expected {list(spec.shape)}")
            device_outputs[spec.name].view(spec.shape, spec.dtype)[...] = value.reshape(spec.shape)

    def _execute_simulator(self, g: _Graph, device_inputs, device_outputs, meta: GraphMeta) -> None:
        ins = [device_inputs[spec.name] for spec in meta.inputs]
        outs = [device_outputs[spec.name] for spec in meta.outputs]
        new = []
        for buf in ins + outs:
            if buf.id not in self._mapped:
                new.append([buf.id, buf.name, buf.nbytes])
        reply = self._worker.request({"op": "run", "graph": g.name, "map": new, "in": [b.id for b in ins],
                                      "out": [b.id for b in outs]})
        if not reply.get("ok"):
            said = "; ".join(reply.get("messages") or [])
            raise RuntimeError(f"rknn executor: graph {meta.name!r} failed in the simulator: {reply.get('error')}"
                               + (f"; the toolkit says: {said}" if said else ""))
        self._mapped.update(b[0] for b in new)

    def _alloc_device(self, nbytes: int):
        if self.runtime == "simulator":
            self._next_id += 1
            return ShmBuffer(nbytes, self._next_id)
        return super()._alloc_device(nbytes)

    def _free_device(self, device_buffer) -> None:
        if isinstance(device_buffer, ShmBuffer):
            device_buffer.release()

    def _unload_graph(self, graph_handle) -> None:
        g: _Graph = graph_handle
        if g.rknn is not None:
            g.rknn.release()

    def close(self) -> None:
        super().close()
        self._mapped.clear()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
