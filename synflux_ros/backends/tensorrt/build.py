"""``synflux-build --backend tensorrt``: ONNX graph set -> TensorRT engines, one per graph kind.

::

    synflux-build --config config/vla_demo_orin.yaml --out engines/vla_demo_orin --backend tensorrt --fp16
    synflux-build ... --backend tensorrt --fp16 --dla-core 0          # vision encoder + action expert on DLA
    synflux-build ... --backend tensorrt --int8 --calib DIR          # vision encoder in int8 (calibrated)

Builds the portable ONNX set, the shape-polymorphic ONNX of the profiled kinds
(:mod:`synflux_ros.backends.tensorrt.build_onnx`), then one engine per
:class:`~synflux_ros.backends.tensorrt.plan.EngineSpec` into ``tensorrt/<sm..-precision[-dlaN]>/``, described
by ``tensorrt.json`` there; each step is skipped while its key is unchanged (``--force`` redoes it).
``--tensorrt-module tensorrt_rtx_bindings`` (TensorRT-RTX) parses and builds without a GPU, which is how the
tests check the build path of every config. The sidecar format, precisions and DLA fallback are described
in docs/internals/build.md.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass

from . import plan, sidecar
from .options import PRECISIONS
from ...graphset import cache, reader as graphset
from ...graphkit.builder import BuildError, Builder

JETPACK_HINT = ("TensorRT comes with JetPack on a Jetson (python3-libnvinfer); on an x86 workstation with an "
                "NVIDIA GPU, NVIDIA's tensorrt wheel")


class TensorRTBuildError(BuildError):
    """An engine cannot be built: no TensorRT, an operator it cannot parse, a layer DLA cannot run."""


@dataclass(frozen=True)
class TensorRTOptions:
    """Builder options (the ``synflux-build`` flags)."""
    precision: str = "fp32"
    calib_dir: str | None = None
    dla_core: int | None = None
    gpu_fallback: bool = True
    workspace_mb: int = 0
    """Workspace memory pool limit; 0 = TensorRT's default (the device's memory)."""
    module: str = "tensorrt"
    sm: str | None = None
    """Compute capability to build for (``8.7`` = Jetson Orin); default: the device's, via cuda-python."""

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise TensorRTBuildError(f"precision {self.precision!r} (choices: {', '.join(PRECISIONS)})")
        if self.precision == "int8" and not self.calib_dir:
            raise TensorRTBuildError("--int8 needs --calib DIR (npz batches of the vision encoder's pixel_values)")
        if self.calib_dir and self.precision != "int8":
            raise TensorRTBuildError("--calib is for --int8")
        if self.dla_core is not None and (isinstance(self.dla_core, bool) or int(self.dla_core) < 0):
            raise TensorRTBuildError(f"--dla-core must be an integer >= 0, got {self.dla_core!r}")
        if self.dla_core is not None and self.precision == "fp32":
            raise TensorRTBuildError("DLA runs fp16 or int8 only: add --fp16 (or --int8 --calib DIR) to --dla-core")
        if self.workspace_mb < 0:
            raise TensorRTBuildError(f"--workspace must be >= 0 MB, got {self.workspace_mb}")
        if self.sm is not None and not _valid_sm(self.sm):
            raise TensorRTBuildError(f"--sm {self.sm!r}: expected MAJOR.MINOR, e.g. 8.7 (Jetson Orin)")

    def flags(self) -> dict:
        """What the key covers besides ONNX, TensorRT version and device."""
        d = dataclasses.asdict(self)
        for k in ("module", "sm", "calib_dir"):
            d.pop(k)
        d["calib"] = cache.digest(sorted(glob.glob(os.path.join(self.calib_dir, "*.npz")))) if self.calib_dir else ""
        return d


def _target_sm(opts: TensorRTOptions) -> str:
    """The compute capability the engines are for. TensorRT builds for the GPU it runs on, so ``--sm``
    may only name that one; TensorRT-RTX (no GPU needed) builds for the one named."""
    if opts.module == "tensorrt_rtx_bindings":
        if not opts.sm:
            raise TensorRTBuildError("--tensorrt-module tensorrt_rtx_bindings needs --sm (e.g. 8.6): there is no "
                                     "device to take it from")
        return opts.sm
    sm = device_sm()
    if opts.sm and opts.sm != sm:
        raise TensorRTBuildError(f"--sm {opts.sm}: TensorRT builds for the GPU it runs on, which is sm {sm}; build "
                                 f"on the device the engines are for")
    return sm


def _valid_sm(sm: str) -> bool:
    major, dot, minor = str(sm).partition(".")
    return bool(dot) and major.isdigit() and minor.isdigit()


def load_tensorrt(module: str = "tensorrt"):
    """The TensorRT Python module, or TensorRTBuildError with how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TensorRTBuildError(f"cannot import {module!r} ({exc}): {JETPACK_HINT}; or --tensorrt-module "
                                 f"tensorrt_rtx_bindings (pip install tensorrt-rtx-cu12-bindings "
                                 f"tensorrt-rtx-cu12-libs) to check the build on a machine without a GPU") from exc


def device_sm() -> str:
    """Compute capability of CUDA device 0 (``8.7``), through cuda-python."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise TensorRTBuildError(f"no --sm given and cuda-python is not installed to ask the device ({exc}); "
                                 f"pip install cuda-python, or pass --sm 8.7 (Jetson Orin)") from exc
    err, major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, 0)
    if int(err) == 0:
        err, minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, 0)
    if int(err) != 0:
        raise TensorRTBuildError(f"no CUDA device to build for ({cudart.cudaGetErrorName(err)[1].decode()}); "
                                 f"pass --sm MAJOR.MINOR to build for another device (8.7 = Jetson Orin)")
    return f"{major}.{minor}"


class _Log:
    """A TensorRT logger that keeps the errors, to quote them in the build error, and prints nothing (the
    builder's progress is ours). TensorRT keeps the first logger of a process while any builder or runtime
    is alive, so errors are quoted only where the build runs in a process of its own (synflux-build)."""

    def __new__(cls, trt):
        class Log(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.errors: list[str] = []

            def log(self, severity, msg):
                if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                    self.errors.append(str(msg))
        return Log()


def parse(trt, logger, onnx_path: str, name: str):
    """(builder, network, parser) for ``onnx_path``; TensorRTBuildError naming node and op on failure."""
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):
        problems = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            problems.append(f"node {err.node_name() or err.node()!s} ({err.node_operator() or '?'}): {err.desc()}")
        raise TensorRTBuildError(f"engine {name}: TensorRT cannot parse {onnx_path}: " + "; ".join(problems))
    return builder, network, parser


def dla_fallback_layers(config, network) -> list[tuple[str, str]]:
    """(layer name, layer type) of every layer the configured DLA core cannot run."""
    out = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if not config.can_run_on_DLA(layer):
            out.append((layer.name, str(layer.type).split(".")[-1]))
    return out


def _add_profiles(trt, builder, config, network, spec: plan.EngineSpec) -> None:
    dynamic = [network.get_input(i) for i in range(network.num_inputs)
               if any(int(d) < 0 for d in network.get_input(i).shape)]
    if not dynamic:
        return
    for profile in spec.profiles:
        prof = builder.create_optimization_profile()
        for tensor in dynamic:
            shape = profile.shape(tensor.name)
            if shape is None:
                raise TensorRTBuildError(f"engine {spec.name}: input {tensor.name!r} has dynamic shape "
                                         f"{list(tensor.shape)} but profile {profile.graph!r} gives it no size")
            prof.set_shape(tensor.name, shape, shape, shape)
        config.add_optimization_profile(prof)


def _configure(trt, builder, config, network, spec: plan.EngineSpec, opts: TensorRTOptions,
               calibrator) -> list[tuple[str, str]]:
    """Precision, workspace, DLA; returns the layers that fall back from DLA to the GPU."""
    if opts.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opts.workspace_mb) << 20)
    precision = opts.precision
    if precision == "int8" and spec.kind != "vision_encoder":
        precision = "fp16"  # int8 calibration covers the vision encoder; the rest runs fp16
    for flag in {"fp16": ("FP16",), "int8": ("FP16", "INT8")}.get(precision, ()):
        if not hasattr(trt.BuilderFlag, flag):
            raise TensorRTBuildError(f"{opts.module} has no BuilderFlag.{flag} (TensorRT-RTX builds the types "
                                     f"of the network as given): build --{precision} with JetPack's TensorRT")
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if precision == "int8":
        config.int8_calibrator = calibrator
    if precision == "fp32" and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: TF32 matmuls are ~1e-3 off
    if not spec.dla:
        return []
    if builder.num_DLA_cores <= opts.dla_core:
        raise TensorRTBuildError(f"engine {spec.name}: --dla-core {opts.dla_core}, but this device has "
                                 f"{builder.num_DLA_cores} DLA cores (Jetson AGX Orin has 2, Orin NX 1 or 2)")
    config.default_device_type = trt.DeviceType.DLA
    config.DLA_core = int(opts.dla_core)
    fallback = dla_fallback_layers(config, network)
    check_dla(spec, fallback, opts)
    if opts.gpu_fallback:
        config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    return fallback


def check_dla(spec: plan.EngineSpec, fallback: list[tuple[str, str]], opts: TensorRTOptions) -> None:
    """Layers DLA cannot run are an error without GPU fallback (naming them), else they run on the GPU."""
    if fallback and not opts.gpu_fallback:
        names = ", ".join(f"{n} ({t})" for n, t in fallback[:10])
        more = f" and {len(fallback) - 10} more" if len(fallback) > 10 else ""
        raise TensorRTBuildError(f"engine {spec.name}: {len(fallback)} layers cannot run on DLA core "
                                 f"{opts.dla_core} and GPU fallback is off: {names}{more}")


def build_engine(trt, graph_dir: str, spec: plan.EngineSpec, opts: TensorRTOptions, timing: bytes = b"",
                 calibrator=None) -> tuple[bytes, bytes, list]:
    """Serialized engine of ``spec``, the updated timing cache and the layers that fall back from DLA."""
    logger = _Log(trt)
    onnx_path = os.path.join(graph_dir, spec.onnx)
    builder, network, _parser = parse(trt, logger, onnx_path, spec.name)
    if calibrator is not None:
        calibrator.shapes = {network.get_input(i).name: tuple(network.get_input(i).shape)
                             for i in range(network.num_inputs)}
    config = builder.create_builder_config()
    _add_profiles(trt, builder, config, network, spec)
    fallback = _configure(trt, builder, config, network, spec, opts, calibrator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TensorRT-RTX: timing-cache calls are no-ops
        cache = config.create_timing_cache(timing)
        if not config.set_timing_cache(cache, False) and timing:  # from another TensorRT version: start anew
            cache = config.create_timing_cache(b"")
            config.set_timing_cache(cache, False)
    serialized = builder.build_serialized_network(network, config)
    if calibrator is not None and calibrator.error:
        raise TensorRTBuildError(f"engine {spec.name}: INT8 calibration: {calibrator.error}")
    if serialized is None:
        detail = "; ".join(logger.errors[-5:]) or "no reason given"
        raise TensorRTBuildError(f"engine {spec.name}: TensorRT could not build {onnx_path}: {detail}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        timing = bytes(cache.serialize())
    return bytes(serialized), timing, fallback


def _calibrator(trt, spec: plan.EngineSpec, opts: TensorRTOptions, out_dir: str, key: str):
    """A fresh INT8 calibrator for an engine that builds in int8; its table is kept per engine key, so new
    batches, weights or TensorRT calibrate anew."""
    if opts.precision != "int8" or spec.kind != "vision_encoder":
        return None
    from .build_calib import EntropyCalibrator
    return EntropyCalibrator(trt, opts.calib_dir, os.path.join(out_dir, f"{spec.name}-{key}.calib"))


def engine_dir(graph_dir: str, sm: str, opts: TensorRTOptions) -> str:
    return os.path.join(graph_dir, "tensorrt", plan.device_tag(sm, opts.dla_core, opts.precision))


def build_engines(graph_dir: str, metas, opts: TensorRTOptions, force: bool = False,
                  progress=print) -> sidecar.Sidecar:
    """Build every stale engine of the graph set in ``graph_dir``; returns the sidecar written."""
    trt = load_tensorrt(opts.module)
    sm = _target_sm(opts)
    dla_kinds = plan.DLA_CAPABLE if opts.dla_core is not None else ()
    engines = plan.plan_engines(metas, dla_kinds)
    out_dir = engine_dir(graph_dir, sm, opts)
    old = {}
    if not force and os.path.isfile(sidecar.sidecar_path(out_dir)):
        try:
            old = sidecar.read(out_dir).engines
        except sidecar.SidecarError as exc:
            raise TensorRTBuildError(f"{sidecar.sidecar_path(out_dir)}: {exc}; add --force to build every engine "
                                     f"again") from None
    os.makedirs(out_dir, exist_ok=True)
    timing_path = os.path.join(out_dir, "timing.cache")
    timing = b""
    if os.path.isfile(timing_path) and not force:
        with open(timing_path, "rb") as fh:
            timing = fh.read()
    flags = opts.flags()
    entries = {}
    progress(f"synflux-build: {len(engines)} TensorRT engines ({opts.module} {trt.__version__}, sm {sm}, "
             f"{opts.precision}{'' if opts.dla_core is None else f', DLA core {opts.dla_core}'}) -> {out_dir}")
    for i, spec in enumerate(engines):
        tag = f"  [{i + 1}/{len(engines)}] {spec.name}"
        key = plan.engine_key(spec, onnx_digest(graph_dir, spec), trt.__version__, sm,
                              opts.dla_core, flags)
        prev = old.get(spec.name)
        if prev is not None and prev.key == key and os.path.isfile(os.path.join(out_dir, prev.file)):
            progress(f"{tag}: unchanged, skipped")
            entries[spec.name] = prev
            continue
        progress(f"{tag}: building ({len(spec.profiles)} profiles{', DLA' if spec.dla else ''}) ...")
        t0 = time.perf_counter()
        blob, timing, fallback = build_engine(trt, graph_dir, spec, opts, timing,
                                              _calibrator(trt, spec, opts, out_dir, key))
        seconds = time.perf_counter() - t0
        file = f"{spec.name}.engine"
        _write_atomic(os.path.join(out_dir, file), blob)
        entries[spec.name] = sidecar.EngineEntry(
            file=file, onnx=spec.onnx, key=key, kind=spec.kind, profiles=tuple(p.graph for p in spec.profiles),
            dla=spec.dla, bytes=len(blob), seconds=round(seconds, 2),
            dla_fallback_layers=tuple(tuple(x) for x in fallback))
        more = f", {len(fallback)} layers fall back to the GPU" if fallback else ""
        progress(f"{tag}: {len(blob) / 2**20:.1f} MiB in {seconds:.1f} s{more}")
    if timing:
        _write_atomic(timing_path, timing)
    graph_keys = {g["name"]: g.get("key", "") for g in graphset.read_manifest(graph_dir).get("graphs", [])}
    side = sidecar.Sidecar(tensorrt=trt.__version__, module=opts.module, sm=sm, dla_core=opts.dla_core,
                           precision=opts.precision, flags=flags, graph_keys=graph_keys, engines=entries)
    sidecar.write(out_dir, side)
    return side


def onnx_digest(graph_dir: str, spec: plan.EngineSpec) -> str:
    """sha256 of an engine's ONNX file and of the external weight bytes it references."""
    path = os.path.join(graph_dir, spec.onnx)
    if not os.path.isfile(path):
        raise TensorRTBuildError(f"engine {spec.name}: {path} is missing; "
                                 f"{graphset.BUILD_HINT.format(dir=graph_dir)} --backend tensorrt")
    base = os.path.dirname(path)
    ranges = [(os.path.join(base, t.location), t.offset, t.length)
              for t in sorted(graphset.external_initializers(path), key=lambda t: (t.location, t.offset))]
    return cache.digest([path] + ranges)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _profiled_key(manifest: dict) -> str:
    """What the shape-polymorphic ONNX depend on: the static graphs' keys (contract, weights, tools) and
    the source of their export."""
    here = os.path.dirname(os.path.abspath(__file__))
    keys = [f"{g['name']}={g.get('key', '')};" for g in sorted(manifest["graphs"], key=lambda g: g["name"])
            if g["kind"] in ("embed", "prefill", "decode", "action_expert", "action_expert_vjp", *plan.GROOT_KINDS)]
    return cache.digest([os.path.join(here, "build_onnx.py"), os.path.join(here, "build_models.py")],
                        head=keys, length=16)


def export_profiled(cfg, out: str, manifest: dict, hf_dir: str | None, seed: int, force: bool, progress=print) -> None:
    """``out/tensorrt/onnx/<kind>.onnx`` from the weights of the graph set (skipped while up to date)."""
    from .build_onnx import export_profiled_graphs, profiled_graph_names
    onnx_dir = os.path.join(out, plan.ONNX_SUBDIR)
    key_path = os.path.join(onnx_dir, "key.json")
    key = _profiled_key(manifest)
    kinds = profiled_graph_names(cfg)
    if not force and os.path.isfile(key_path):
        with open(key_path, encoding="utf-8") as fh:
            if json.load(fh).get("key") == key and all(
                    os.path.isfile(os.path.join(onnx_dir, f"{k}.onnx")) for k in kinds):
                progress(f"  profiled ONNX ({', '.join(kinds)}): unchanged, skipped")
                return
    from ...graphkit.torch_models import build_graph_modules
    t0 = time.perf_counter()
    progress(f"  profiled ONNX ({', '.join(kinds)}): exporting ...")
    modules = build_graph_modules(cfg, seed=seed, hf_dir=hf_dir)
    os.makedirs(onnx_dir, exist_ok=True)
    export_profiled_graphs(cfg, modules, onnx_dir)
    _write_atomic(key_path, json.dumps({"key": key, "graphs": kinds}).encode())
    progress(f"  profiled ONNX: done in {time.perf_counter() - t0:.1f} s")


def build_for_tensorrt(cfg, out: str, manifest: dict, hf_dir: str | None, seed: int, force: bool,
                       opts: TensorRTOptions, progress=print) -> sidecar.Sidecar:
    """The shape-polymorphic ONNX, then the engines (the portable set exists); returns the engines' sidecar."""
    export_profiled(cfg, out, manifest, hf_dir, seed, force, progress)
    return build_engines(out, graphset.graph_metas(out, manifest), opts, force=force, progress=progress)


def check_engines(graph_dir: str, metas, opts: TensorRTOptions) -> list:
    """``synflux-build --check`` for TensorRT: per engine, does it parse and build, and (with a DLA core)
    which layers would fall back from DLA to the GPU. Rows as :class:`synflux_ros.buildtool.check.GraphCheck`."""
    trt = load_tensorrt(opts.module)
    dla_kinds = plan.DLA_CAPABLE if opts.dla_core is not None else ()
    with tempfile.TemporaryDirectory(prefix="synflux_trt_check_") as tmp:
        return [_check_engine(trt, graph_dir, spec, opts, tmp) for spec in plan.plan_engines(metas, dla_kinds)]


def _check_engine(trt, graph_dir: str, spec: plan.EngineSpec, opts: TensorRTOptions, tmp: str):
    from ...graphkit.builder import GraphCheck
    try:
        _blob, _timing, fallback = build_engine(trt, graph_dir, spec, opts,
                                                calibrator=_calibrator(trt, spec, opts, tmp, "check"))
    except TensorRTBuildError as exc:
        return GraphCheck(spec.name, False, str(exc))
    return GraphCheck(spec.name, True, unsupported=[(n, f"{t}, GPU fallback") for n, t in fallback])


class TensorRTBuilder(Builder):
    """``synflux-build --backend tensorrt``: the shape-polymorphic ONNX per graph kind, then one engine per kind
    with a profile per bucket, cached under the device and flags it was built for."""

    name = "tensorrt"
    options_type = TensorRTOptions
    description = ("portable ONNX, shape-polymorphic ONNX per graph kind, then one TensorRT engine per kind with a "
                   "profile per bucket (JetPack's TensorRT; --tensorrt-module tensorrt_rtx_bindings on a CPU)")

    def add_arguments(self, group) -> None:
        group.add_argument("--fp16", action="store_true", help="build the engines in fp16 (needed for DLA)")
        group.add_argument("--int8", action="store_true", help="vision encoder in int8, calibrated on --calib")
        group.add_argument("--dla-core", type=int, default=None, metavar="N",
                           help="build the vision encoder and action expert for DLA core N (GPU fallback per layer)")
        group.add_argument("--no-gpu-fallback", action="store_true",
                           help="with --dla-core: a layer DLA cannot run is an error instead of running on the GPU")
        group.add_argument("--workspace", type=int, default=0, metavar="MB",
                           help="builder workspace limit (0: TensorRT's)")
        group.add_argument("--sm", default=None,
                           help="compute capability to build for (default: the device's; 8.7 = Orin)")
        group.add_argument("--tensorrt-module", default="tensorrt",
                           help="Python module of TensorRT (tensorrt_rtx_bindings: TensorRT-RTX, builds without a GPU)")

    def options_from_args(self, args) -> TensorRTOptions:
        if args.fp16 and args.int8:
            raise BuildError("--fp16 and --int8: choose one (--int8 builds the other engines in fp16)")
        return TensorRTOptions(precision="int8" if args.int8 else "fp16" if args.fp16 else "fp32",
                               calib_dir=args.calib, dla_core=args.dla_core, gpu_fallback=not args.no_gpu_fallback,
                               workspace_mb=args.workspace, module=args.tensorrt_module, sm=args.sm)

    def prepare(self, options, weights: str) -> TensorRTOptions:
        options = options or TensorRTOptions()
        load_tensorrt(options.module)
        return options

    def compile(self, cfg, out, manifest, options, *, hf_dir, seed, force, progress) -> None:
        build_for_tensorrt(cfg, out, manifest, hf_dir, seed, force, options, progress=progress)

    def check(self, out, metas, options) -> list:
        return check_engines(out, metas, options or TensorRTOptions())
