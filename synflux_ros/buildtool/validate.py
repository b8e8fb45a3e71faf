"""synflux-validate: does a backend compute what the reference backend computes on the same graph set?

::

    synflux-validate --graphs DIR --backend openvino [--reference onnxruntime] [--options JSON]
                     [--reference-options JSON] [--precision fp32|reduced] [--json FILE]

1. Every graph of the set runs on both executors with the same seeded inputs (token ids inside the
   vocabulary, cache positions inside each bucket's span, a random KV cache); each output is compared
   by max |diff| and cosine similarity.
2. The whole model: for an LLM/VLM set, greedy tokens of a two-turn conversation (n of N agreeing,
   position by position up to the first difference), and the second turn with cache reuse against the same
   turn recomputed from the whole history on the backend under test; for a VLA set, the action chunk of a
   few camera frames (cosine, max |diff|).

Each backend is loaded once (its runtime: the graph checks run on its executor, with the random KV cache in
one of its cache slots), which matters where a load compiles every graph (simulators, TensorRT).

Thresholds: with ``--precision fp32`` (default) an output passes when max |diff| <= ``--atol``
(1e-4; for an output stored in float16, such as the new KV entries of an fp16 cache, at least two fp16
rounding steps at its largest magnitude, max|ref| / 512); with ``--precision reduced`` (fp16 devices, simulators) when cosine >= ``--min-cosine`` (0.99).
Greedy decoding must agree on every token in fp32 and on ``--min-token-agreement`` (0.9) of them in
reduced precision. Exit code 0 when everything passes, 1 when a check fails, 2 on a usage or load error.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np

from ..core.config import ConfigError, ModelConfig, load_config
from ..graphset.reader import MANIFEST_FILE, GraphSetError
from ..graphkit.feeds import seeded_feeds

PROMPTS = ("Describe what the robot sees on the table.", "Which object is closest to the gripper?")
GREEDY_TOKENS = 24
FRAMES = 3


@dataclass
class Comparison:
    check: str  # graph/output, or a whole-model check
    max_abs_diff: float
    cosine: float
    passed: bool
    detail: str = ""


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def _on(cfg: ModelConfig, backend: str, graph_dir: str, options: dict) -> ModelConfig:
    """``cfg`` running on ``backend`` with ``options`` over the graph set in ``graph_dir``."""
    return cfg.with_overrides(executor={"backend": backend, "graph_dir": graph_dir, "options": options,
                                        "latency_ms": {}, "placement": {}})


def runtime_on(cfg: ModelConfig, backend: str, graph_dir: str, options: dict):
    """The config's runtime (VLM or VLA) on ``backend``: the one executor load that both the graph checks and
    the whole-model checks use (a load compiles every graph on some backends)."""
    if cfg.mode == "vlm":
        from ..runtimes.vlm import VLMRuntime
        return VLMRuntime(_on(cfg, backend, graph_dir, options))
    from ..runtimes.vla import VLARuntime
    return VLARuntime(_on(cfg, backend, graph_dir, options))


def compare_graphs(cfg: ModelConfig, rt, rt_ref, passes, seed: int = 0) -> list[Comparison]:
    """Every graph on both runtimes' executors with the same seeded inputs; one row per output. The random
    KV cache is written into a slot of each runtime's pool (a slot's contents are its user's to track)."""
    ex, ref = rt.executor, rt_ref.executor
    cached = rt.kv_pool is not None  # (GR00T's graphs keep no KV cache)
    slot, slot_ref = (rt.kv_pool.acquire(), rt_ref.kv_pool.acquire()) if cached else (None, None)
    rows = []
    try:
        kv = kv_ref = None
        if cached:
            kv_shape, kv_dtype = cfg.llm.kv_shape, cfg.llm.kv_dtype
            rng = np.random.default_rng(seed)
            kv_value = (rng.standard_normal(kv_shape) * 0.5).astype(kv_dtype)
            kv, kv_ref = rt.kv_pool.tensor(slot), rt_ref.kv_pool.tensor(slot_ref)
            ex.write(kv, (), kv_value)
            ref.write(kv_ref, (), kv_value)
        for i, meta in enumerate(ex.graphs.values()):
            feeds = seeded_feeds(meta, cfg, np.random.default_rng([seed, i]), kv)
            ref_feeds = {k: (kv_ref if v is kv else v) for k, v in feeds.items()}
            got = ex.run(meta.name, feeds)
            want = ref.run(meta.name, ref_feeds)
            for spec in meta.outputs:
                a, b = got[spec.name].astype(np.float64), want[spec.name].astype(np.float64)
                diff = float(np.max(np.abs(a - b))) if a.size else 0.0
                cos = cosine(a, b)
                scale = float(np.max(np.abs(b))) if b.size and spec.dtype == "float16" else 0.0
                rows.append(Comparison(f"{meta.name}/{spec.name}", diff, cos, passes(diff, cos, scale)))
    finally:
        if cached:
            rt.kv_pool.release(slot)
            rt_ref.kv_pool.release(slot_ref)
    return rows


def _agreement(check: str, a, b, min_agreement: float) -> Comparison:
    """Greedy token sequences ``a`` and ``b`` agreeing position by position up to the first difference."""
    agree = 0
    for x, y in zip(a, b):
        if x != y:
            break
        agree += 1
    n = max(len(a), len(b))
    share = agree / n if n else 1.0
    return Comparison(check, math.nan, share, share >= min_agreement, f"{agree}/{n} agree")


def compare_model(cfg: ModelConfig, rt, rt_ref, passes, min_agreement: float) -> list[Comparison]:
    """The whole model on both runtimes: greedy chat tokens (VLM/LLM sets: a conversation of two turns, the
    second reusing the first's cache, and on the backend under test the same turns recomputed without
    reuse), or action chunks (VLA sets; pi0-FAST's: its generated tokens)."""
    if cfg.mode == "vlm":
        from ..runtimes.vlm import ChatRequest

        def conversation(runtime, session, reuse=None):
            return [runtime.chat(ChatRequest(session, p, max_new_tokens=GREEDY_TOKENS, temperature=0.0,
                                             reuse_kv_cache=reuse)).token_ids for p in PROMPTS]
        got, want = conversation(rt, "validate"), conversation(rt_ref, "validate")
        recomputed = conversation(rt, "validate-recompute", reuse=False)
        rows = [_agreement(f"greedy tokens, turn {t + 1}", a, b, min_agreement)
                for t, (a, b) in enumerate(zip(got, want))]
        rows += [_agreement(f"turn {t + 1}: cache reuse against recompute", a, b, min_agreement)
                 for t, (a, b) in enumerate(zip(got, recomputed)) if t > 0]
        return rows
    cams = rt.cfg.vision.num_cameras
    frames = [[np.random.default_rng([7, i, c]).integers(0, 256, (240, 320, 3), np.uint8) for c in range(cams)]
              for i in range(FRAMES)]
    rows = []
    state_dim = rt.cfg.action.state_dim
    fast = rt.cfg.action.token_codec == "fast"
    for i, frame in enumerate(frames):
        state = np.random.default_rng([8, i]).uniform(-1, 1, state_dim).astype(np.float32) if state_dim else None
        if fast:  # pi0-FAST: the generated tokens (a random model's do not decode to actions)
            rows.append(_agreement(f"FAST action tokens, frame {i}", rt.action_tokens(frame, i, state),
                                   rt_ref.action_tokens(frame, i, state), min_agreement))
            continue
        a = rt.infer(frame, seq=i, state=state).actions
        b = rt_ref.infer(frame, seq=i, state=state).actions
        diff = float(np.max(np.abs(a.astype(np.float64) - b)))
        rows.append(Comparison(f"action chunk, frame {i}", diff, cosine(a, b), passes(diff, cosine(a, b))))
    return rows


def validate(graph_dir: str, backend: str, reference: str = "onnxruntime", options: dict | None = None,
             ref_options: dict | None = None, precision: str = "fp32", atol: float = 1e-4,
             min_cosine: float = 0.99, min_token_agreement: float = 0.9) -> list[Comparison]:
    manifest = os.path.join(graph_dir, MANIFEST_FILE)
    if not os.path.isfile(manifest):
        raise GraphSetError(f"{manifest} not found: --graphs must be a graph set built by synflux-build")
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    if precision == "fp32":
        def passes(diff, cos, fp16_scale=0.0):
            return diff <= max(atol, fp16_scale / 512.0)
        agreement = 1.0
    else:
        def passes(diff, cos, fp16_scale=0.0):
            return cos >= min_cosine
        agreement = min_token_agreement
    rt = runtime_on(cfg, backend, graph_dir, options or {})
    try:
        rt_ref = runtime_on(cfg, reference, graph_dir, ref_options or {})
        try:
            return compare_graphs(cfg, rt, rt_ref, passes) + compare_model(cfg, rt, rt_ref, passes, agreement)
        finally:
            rt_ref.close()
    finally:
        rt.close()


def _json_arg(text: str, flag: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise SystemExit(f"synflux-validate: {flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"synflux-validate: {flag}: expected a JSON object, got {text!r}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="synflux-validate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", required=True, help="graph set directory (synflux-build --out)")
    ap.add_argument("--backend", required=True, help="backend under test")
    ap.add_argument("--reference", default="onnxruntime", help="reference backend (default onnxruntime)")
    ap.add_argument("--options", default="", help="executor options of the backend under test, JSON")
    ap.add_argument("--reference-options", default="", help="executor options of the reference, JSON")
    ap.add_argument("--precision", choices=("fp32", "reduced"), default="fp32",
                    help="fp32: max |diff| <= --atol; reduced (fp16, simulators): cosine >= --min-cosine")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--min-cosine", type=float, default=0.99)
    ap.add_argument("--min-token-agreement", type=float, default=0.9,
                    help="share of greedy tokens that must agree in reduced precision (fp32: all)")
    ap.add_argument("--json", help="write the rows and the verdict to this file")
    args = ap.parse_args(argv)
    try:
        rows = validate(os.path.abspath(args.graphs), args.backend, args.reference,
                        _json_arg(args.options, "--options"), _json_arg(args.reference_options, "--reference-options"),
                        args.precision, args.atol, args.min_cosine, args.min_token_agreement)
    except (ConfigError, GraphSetError, ImportError, ValueError, FileNotFoundError) as exc:
        print(f"synflux-validate: {exc}", file=sys.stderr)
        return 2
    width = max(len(r.check) for r in rows)
    print(f"{args.backend} against {args.reference} on {args.graphs} ({args.precision})")
    print(f"{'check':<{width}}  {'max |diff|':>11}  {'cosine':>9}  result")
    for r in rows:
        diff = "" if math.isnan(r.max_abs_diff) else f"{r.max_abs_diff:11.3e}"
        print(f"{r.check:<{width}}  {diff:>11}  {r.cosine:9.6f}  {'pass' if r.passed else 'FAIL'} {r.detail}")
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks within the thresholds")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"backend": args.backend, "reference": args.reference, "precision": args.precision,
                       "passed": not failed,
                       "rows": [{**asdict(r), "max_abs_diff": None if math.isnan(r.max_abs_diff) else r.max_abs_diff}
                                for r in rows]}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
