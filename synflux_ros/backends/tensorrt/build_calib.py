"""INT8 calibration for ``synflux-build --backend tensorrt --int8 --calib DIR`` (runs on a machine with
JetPack's TensorRT and a CUDA device; TensorRT-RTX has no INT8 calibration).

``DIR`` holds ``*.npz`` files, each one batch: an array per engine input by name (for the vision encoder,
``pixel_values`` [T, 3, h, w] float32, preprocessed as the node does: ``synflux_ros.model.image``). The
calibration table is written beside the engines (``<engine>-<key>.calib``, keyed like the engine) and read
back while the key holds, so new batches, weights or TensorRT versions calibrate anew. Batches are converted to float32 and checked
against the engine's input shapes; a bad batch stops the calibration and is named in the build error.
"""
from __future__ import annotations

import glob
import os

import numpy as np


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error in {what}: {err}")
    return rest[0] if len(rest) == 1 else rest


def EntropyCalibrator(trt, calib_dir: str, cache_path: str, shapes: dict | None = None):  # noqa: N802
    """An ``IInt8EntropyCalibrator2`` over the batches in ``calib_dir`` (float32 arrays; ``shapes``: the
    engine's input shapes, checked per batch)."""
    from cuda.bindings import runtime as cudart
    files = sorted(glob.glob(os.path.join(calib_dir, "*.npz")))
    if not files:
        raise FileNotFoundError(f"--calib {calib_dir}: no *.npz batches there")

    class Calibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.files, self.next = files, 0
            self.buffers: dict[str, tuple[int, int]] = {}
            self.error = ""
            """TensorRT swallows exceptions raised in get_batch (it reads them as the end of the data): the
            first problem is kept here and raised by the builder after the build."""

        def get_batch_size(self):
            return 1

        def get_batch(self, names):
            if self.next >= len(self.files) or self.error:
                self.free()
                return None
            path = self.files[self.next]
            try:
                ptrs = self._upload(path, names)
            except Exception as exc:  # noqa: BLE001 - reported after the build, see error
                self.error = f"{path}: {exc}"
                self.free()
                return None
            self.next += 1
            return ptrs

        def _upload(self, path, names):
            with np.load(path) as batch:
                missing = [n for n in names if n not in batch]
                if missing:
                    raise KeyError(f"no arrays {missing} (has {list(batch)})")
                ptrs = []
                for name in names:
                    arr = np.ascontiguousarray(batch[name], dtype=np.float32)
                    want = self.shapes.get(name)
                    if want is not None and tuple(arr.shape) != tuple(want):
                        raise ValueError(f"{name} is {list(arr.shape)}, the engine takes {list(want)}")
                    ptr, size = self.buffers.get(name, (0, 0))
                    if size < arr.nbytes:
                        if ptr:
                            _check(cudart.cudaFree(ptr), "cudaFree")
                        ptr = _check(cudart.cudaMalloc(arr.nbytes), "cudaMalloc")
                        self.buffers[name] = (ptr, arr.nbytes)
                    _check(cudart.cudaMemcpy(ptr, arr.ctypes.data, arr.nbytes,
                                             cudart.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy")
                    ptrs.append(int(ptr))
            return ptrs

        def free(self):
            for ptr, _ in self.buffers.values():
                cudart.cudaFree(ptr)
            self.buffers.clear()

        def read_calibration_cache(self):
            if os.path.isfile(cache_path):
                with open(cache_path, "rb") as fh:
                    return fh.read()
            return None

        def write_calibration_cache(self, cache):
            with open(cache_path, "wb") as fh:
                fh.write(bytes(cache))

    calibrator = Calibrator()
    calibrator.shapes = dict(shapes or {})
    return calibrator
