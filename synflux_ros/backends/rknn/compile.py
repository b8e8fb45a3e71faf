"""Compile ONNX graphs to ``.rknn`` files with Rockchip's rknn-toolkit2 (a script, not a module of the package).

It runs under the Python of the RKNN venv (``make rknn-venv`` -> ``.venv-rknn``), because rknn-toolkit2
pins numpy <= 1.26.4 and onnx <= 1.18, which the project's venv cannot take. It therefore imports only
the standard library, numpy and ``rknn.api``; ``synflux_ros.backends.rknn.build`` (``synflux-build --backend
rknn``) writes the job and reads the results.

    python compile.py --version
        prints {"toolkit": "<rknn-toolkit2 version>"} (without importing the toolkit)
    python compile.py --job JOB.json --results-fd N --log LOG
        compiles every graph of the job; one JSON line per graph goes to file descriptor N:
        {"graph": name, "ok": true, "seconds": s} or {"graph": name, "ok": false, "stage": ...,
        "error": ..., "messages": [the toolkit's error lines for this graph]}

JOB.json: {"target": "rk3588", "graphs": [{"name": ..., "onnx": path, "out": path,
"inputs": [[name, shape], ...], "outputs": [name, ...], "quantize": null | {"dtype": "w8a8", "algorithm":
"normal", "method": "channel", "dataset": path of the toolkit's dataset.txt}}, ...]}. The inputs are passed
to the toolkit in the order given (the order the runtime feeds them in). A graph without ``quantize``
compiles in fp16; with it, rknn.config takes its quantized_dtype/algorithm/method and rknn.build quantizes
on its dataset (one line per sample: the .npy file of each input, space-separated, in input order). The
toolkit's own log (stdout/stderr) is expected to go to LOG; error lines are read back from it to say which
node or operator failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

# This script's directory (synflux_ros/backends/rknn/) is sys.path[0] when it runs; its modules (build.py,
# executor.py, worker.py) must not shadow what the toolkit imports, so the directory leaves the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

TOOLKIT_DIST = "rknn-toolkit2"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Error lines of rknn-toolkit2 2.5.0 that say nothing about the graph: logged on every fp16 build
# although the model builds and runs, or repeated around every error.
_HARMLESS = ("Unkown op target", "E rknn-toolkit2 version:", "Traceback (most recent call last)")


def toolkit_version() -> str:
    from importlib import metadata
    return metadata.version(TOOLKIT_DIST)


def error_lines(log_path: str, start: int) -> list[str]:
    """The toolkit's error lines ('E ...') written to the log since byte ``start``."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).strip()
        if (line.startswith("E ") or " E RKNN:" in line or line.startswith("E RKNN")) and \
                not any(h in line for h in _HARMLESS):
            out.append(line)
    return out[-20:]


def _log_size(log_path: str) -> int:
    try:
        return os.path.getsize(log_path)
    except OSError:
        return 0


def config_kwargs(target: str, quantize: dict | None) -> dict:
    """rknn.config() arguments of a graph: fp16, or int8 with the job's quantization choices."""
    kwargs = {"target_platform": target, "float_dtype": "float16"}
    if quantize:
        kwargs.update(quantized_dtype=quantize["dtype"], quantized_algorithm=quantize["algorithm"],
                      quantized_method=quantize["method"])
    return kwargs


def compile_graph(rknn_cls, graph: dict, target: str) -> tuple[str, str]:
    """Compile one graph; returns ("", "") or (failed stage, error)."""
    rknn = rknn_cls(verbose=False)
    stage = "config"
    quantize = graph.get("quantize")
    try:
        if rknn.config(**config_kwargs(target, quantize)) != 0:
            return stage, "config() failed"
        stage = "load_onnx"
        names = [name for name, _ in graph["inputs"]]
        sizes = [list(shape) for _, shape in graph["inputs"]]
        if rknn.load_onnx(model=graph["onnx"], inputs=names, input_size_list=sizes,
                          outputs=list(graph["outputs"])) != 0:
            return stage, "load_onnx() failed"
        stage = "build"
        if quantize:
            stage = "build (int8 quantization)"
            if rknn.build(do_quantization=True, dataset=quantize["dataset"]) != 0:
                return stage, f"build() failed quantizing on {quantize['dataset']}"
        elif rknn.build(do_quantization=False) != 0:
            return stage, "build() failed"
        stage = "export_rknn"
        partial = graph["out"] + ".partial"
        if rknn.export_rknn(partial) != 0:
            return stage, "export_rknn() failed"
        os.replace(partial, graph["out"])
        return "", ""
    except Exception as exc:  # the toolkit raises its own types (and plain ValueError) after logging
        last = str(exc).strip().splitlines()
        return stage, " ".join(f"{type(exc).__name__}: {last[-1] if last else ''}".split())
    finally:
        try:
            rknn.release()
        except Exception:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="compile ONNX graphs to .rknn (runs under the RKNN venv)")
    ap.add_argument("--version", action="store_true")
    ap.add_argument("--job")
    ap.add_argument("--results-fd", type=int)
    ap.add_argument("--log", default="")
    args = ap.parse_args(argv)
    if args.version:
        print(json.dumps({"toolkit": toolkit_version(), "python": sys.version.split()[0]}))
        return 0
    if not args.job or args.results_fd is None:
        ap.error("--job and --results-fd are required")
    with open(args.job, encoding="utf-8") as fh:
        job = json.load(fh)
    results = os.fdopen(args.results_fd, "w", encoding="utf-8", buffering=1)
    from rknn.api import RKNN

    failed = 0
    for graph in job["graphs"]:
        print(f"=== synflux: compiling {graph['name']} for {job['target']} ===", flush=True)
        start = _log_size(args.log)
        t0 = time.perf_counter()
        stage, error = compile_graph(RKNN, graph, job["target"])
        sys.stdout.flush()
        sys.stderr.flush()
        row = {"graph": graph["name"], "ok": not stage, "seconds": round(time.perf_counter() - t0, 2)}
        if stage:
            failed += 1
            row.update(stage=stage, error=error, messages=error_lines(args.log, start) if args.log else [])
        results.write(json.dumps(row) + "\n")
    results.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
