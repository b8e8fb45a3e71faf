"""Simulator worker of the rknn executor (a script, not a module of the package).

It runs under the Python of the RKNN venv (``.venv-rknn``: rknn-toolkit2 pins numpy <= 1.26.4, which the
project's venv cannot take), so it imports only the standard library, numpy and ``rknn.api``. The executor
(:mod:`synflux_ros.backends.rknn.executor`) talks to it over two pipes, one JSON object per line (``load``,
``run``, ``close``; every failure answers ``{"ok": false, "error": ..., "messages": [...]}``); tensors stay in
the executor's shared-memory buffers, which this process maps once. The simulator cannot run a ``.rknn`` file,
so each graph is built again here from its ONNX source. The protocol: docs/backends/rknn.md#simulator-worker.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import sys
import time

# This file's directory holds modules of synflux_ros (build.py, options.py, ...), which must not shadow the
# toolkit's own imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Error lines of rknn-toolkit2 2.5.0 that say nothing about the graph: logged on every fp16 build
# although the model builds and runs, or repeated around every error.
_HARMLESS = ("Unkown op target", "E rknn-toolkit2 version:", "Traceback (most recent call last)")


class Graph:
    def __init__(self, rknn, inputs, outputs):
        self.rknn = rknn
        self.inputs = inputs  # [(shape, dtype, contract index, byte offset)]
        self.outputs = outputs  # [(shape, dtype)]
        self.formats = ["nchw"] * len(inputs)  # 4-D inputs are NCHW as in the ONNX graph


class Worker:
    def __init__(self, log_path: str):
        from rknn.api import RKNN

        self.RKNN = RKNN
        self.log_path = log_path
        self.graphs: dict[str, Graph] = {}
        self.buffers: dict[int, np.ndarray] = {}
        self._maps: list[mmap.mmap] = []

    # ------------------------------------------------------------------ helpers
    def _log_pos(self) -> int:
        try:
            return os.path.getsize(self.log_path) if self.log_path else 0
        except OSError:
            return 0

    def _errors_since(self, start: int) -> list[str]:
        if not self.log_path:
            return []
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(start)
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return []
        lines = [_ANSI.sub("", line).strip() for line in text.splitlines()]
        return [line for line in lines if (line.startswith("E ") or "E RKNN" in line)
                and not any(h in line for h in _HARMLESS)][-20:]

    def _map(self, buf_id: int, name: str, size: int) -> None:
        if buf_id in self.buffers:
            return
        fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps.append(mm)
        self.buffers[buf_id] = np.frombuffer(mm, np.uint8, size)

    # ------------------------------------------------------------------ requests
    def load(self, msg: dict) -> dict:
        start = self._log_pos()
        t0 = time.perf_counter()
        rknn = self.RKNN(verbose=False)
        stage = "config"
        quantize = msg.get("quantize")
        try:
            kwargs = {"target_platform": msg["target"], "float_dtype": "float16"}
            if quantize:
                kwargs.update(quantized_dtype=quantize["dtype"], quantized_algorithm=quantize["algorithm"],
                              quantized_method=quantize["method"])
            if rknn.config(**kwargs) != 0:
                raise RuntimeError("config() failed")
            stage = "load_onnx"
            ins = msg["inputs"]
            if rknn.load_onnx(model=msg["onnx"], inputs=[i[0] for i in ins], input_size_list=[list(i[1]) for i in ins],
                              outputs=[o[0] for o in msg["outputs"]]) != 0:
                raise RuntimeError("load_onnx() failed")
            stage = "build"
            if quantize:
                stage = "build (int8 quantization)"
                if rknn.build(do_quantization=True, dataset=quantize["dataset"]) != 0:
                    raise RuntimeError(f"build() failed quantizing on {quantize['dataset']}")
            elif rknn.build(do_quantization=False) != 0:
                raise RuntimeError("build() failed")
            stage = "init_runtime"
            if rknn.init_runtime() != 0:
                raise RuntimeError("init_runtime() failed")
        except Exception as exc:
            try:
                rknn.release()
            except Exception:
                pass
            last = str(exc).strip().splitlines()
            return {"ok": False, "error": f"{stage}: {last[-1] if last else type(exc).__name__}",
                    "messages": self._errors_since(start)}
        self.graphs[msg["graph"]] = Graph(
            rknn, [(tuple(i[1]), np.dtype(i[2]), int(i[3]), int(i[4])) for i in ins],
            [(tuple(o[1]), np.dtype(o[2])) for o in msg["outputs"]])
        return {"ok": True, "seconds": round(time.perf_counter() - t0, 3)}

    def run(self, msg: dict) -> dict:
        g = self.graphs[msg["graph"]]
        for buf_id, name, size in msg.get("map", ()):
            self._map(int(buf_id), name, int(size))
        src = [self.buffers[int(b)] for b in msg["in"]]
        feeds = []
        for shape, dtype, index, offset in g.inputs:
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            feeds.append(src[index][offset:offset + n].view(dtype).reshape(shape))
        start = self._log_pos()
        t0 = time.perf_counter()
        try:
            outs = g.rknn.inference(inputs=feeds, data_format=g.formats)
        except Exception as exc:
            return {"ok": False, "error": f"inference: {exc}", "messages": self._errors_since(start)}
        ms = (time.perf_counter() - t0) * 1e3
        if outs is None or len(outs) != len(g.outputs):
            return {"ok": False, "error": f"inference returned {None if outs is None else len(outs)} outputs, "
                                          f"expected {len(g.outputs)}", "messages": self._errors_since(start)}
        for (shape, dtype), value, buf_id in zip(g.outputs, outs, msg["out"]):
            value = np.asarray(value)
            n = int(np.prod(shape, dtype=np.int64))
            if value.size != n:
                return {"ok": False, "error": f"an output has {value.size} elements, expected {n} {list(shape)}"}
            dst = self.buffers[int(buf_id)][:n * dtype.itemsize].view(dtype).reshape(shape)
            dst[...] = value.reshape(shape)
        return {"ok": True, "ms": round(ms, 3)}

    def close(self) -> None:
        for g in self.graphs.values():
            try:
                g.rknn.release()
            except Exception:
                pass
        self.graphs.clear()
        self.buffers.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rknn simulator worker (started by the rknn executor)")
    ap.add_argument("--requests", type=int, required=True, help="file descriptor to read requests from")
    ap.add_argument("--replies", type=int, required=True, help="file descriptor to write replies to")
    ap.add_argument("--log", default="", help="the file this process's stdout/stderr go to")
    args = ap.parse_args(argv)
    requests = os.fdopen(args.requests, "r", encoding="utf-8")
    replies = os.fdopen(args.replies, "w", encoding="utf-8", buffering=1)

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")

    try:
        from importlib import metadata
        worker = Worker(args.log)
        reply({"ok": True, "toolkit": metadata.version("rknn-toolkit2"), "pid": os.getpid()})
    except Exception as exc:
        reply({"ok": False, "error": f"cannot import rknn-toolkit2: {type(exc).__name__}: {exc}"})
        return 1
    for line in requests:
        msg = json.loads(line)
        op = msg.get("op")
        try:
            if op == "load":
                reply(worker.load(msg))
            elif op == "run":
                reply(worker.run(msg))
            elif op == "close":
                worker.close()
                reply({"ok": True})
                return 0
            else:
                reply({"ok": False, "error": f"unknown request {op!r}"})
        except Exception as exc:  # keep serving: the executor reports the error with the graph named
            reply({"ok": False, "error": f"{op}: {type(exc).__name__}: {exc}"})
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
