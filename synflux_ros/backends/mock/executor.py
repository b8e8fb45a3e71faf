"""Mock executor: runs any graph set without engine files or an accelerator.

It honours every :class:`GraphMeta` shape and dtype and is *causal*: a prefill or decode graph writes KV
entries that depend on each token and its absolute position, and its logits are a deterministic function
of everything in the cache below the current position. Hence:

* prefilling a conversation in several chunks (reusing the cache) and prefilling it at once give
  bit-identical logits;
* a runtime that writes KV entries at the wrong position, forgets to append them, or reads the wrong
  bucket gets different results (and the mock refuses a bucket too small for the cache position).

Device memory is host memory (one numpy byte buffer per allocation), so the copies the base class makes
are real copies, as they would be on a discrete accelerator.

``options.latency_ms`` simulates device time per graph: keys are a graph name, a graph kind
(``prefill``) or a group. A call then takes at least that long in total (the mock's own arithmetic
included); the wait is a sleep, which releases the GIL like a device wait does.

``options.faults`` injects device faults for tests of the layers above: a list of
``{graph: <name, kind or group>, kind: raise | nan | inf, every: N, first: M}``. The fault hits calls
M, M + N, M + 2N, ... (1-based, counted per entry; defaults every 1, first 1): ``raise`` fails the
call as a device error would, ``nan``/``inf`` fill the graph's floating-point outputs.
"""
from __future__ import annotations

import itertools
import time

import numpy as np

from ...core.config import ConfigError
from ...core.executor import Executor, HostMemoryHooks
from ...core.contract import GraphMeta
from ...core.contract import MASKED_SCORE, TIME_MAX_PERIOD
from ..options import parse_options
from .options import FaultSpec, MockExecutorOptions

_SUMMARY = 16  # readout features that drive logits / actions


class _Fault:
    """One ``options.faults`` entry and how many matching calls it has seen."""

    def __init__(self, spec: FaultSpec):
        if not spec.graph:
            raise ConfigError("mock executor: executor.options.faults: an entry names no graph")
        self.target, self.kind, self.every, self.first = spec.graph, spec.kind, spec.every, spec.first
        self.calls = 0

    def apply(self, meta: GraphMeta, outs: dict) -> None:
        if self.target not in (meta.name, meta.kind, meta.group):
            return
        self.calls += 1
        if self.calls < self.first or (self.calls - self.first) % self.every:
            return
        if self.kind == "raise":
            raise RuntimeError(f"mock executor: injected device fault in graph {meta.name!r} (call {self.calls})")
        value = np.nan if self.kind == "nan" else np.inf
        for out in outs.values():
            if out.dtype.kind == "f":
                out[...] = value


class MockExecutor(HostMemoryHooks, Executor):
    """Runs any graph set without an accelerator: outputs of the contract's shapes, a deterministic function of
    the whole token prefix carried through the KV cache, with optional simulated device latency."""
    name = "mock"
    options_type = MockExecutorOptions
    weight_dtypes = ("float32", "int8", "int4")  # runs no weights: any graph set's contract will do

    def __init__(self, graphs, graph_dir: str = "", options: dict | None = None):
        super().__init__(graphs, graph_dir, options)
        self._mem: dict[int, np.ndarray] = {}
        self._ids = itertools.count(1)
        opts = self.opts = parse_options(self.options_type, options, self.name, ignored=())
        self.latency_ms: dict[str, float] = dict(opts.latency_ms)
        for key, value in self.latency_ms.items():
            if value < 0:
                raise ConfigError(f"mock executor: executor.options.latency_ms.{key}: must be >= 0, got {value}")
        self.faults = [_Fault(f) for f in opts.faults]
        rng = np.random.default_rng(1234)
        self._omega = rng.uniform(0.05, 1.7, size=_SUMMARY).astype(np.float32)
        self._amp = rng.uniform(0.5, 1.5, size=_SUMMARY).astype(np.float32)
        self._embed_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._vision_w: dict[int, np.ndarray] = {}

    # ---------------------------------------------------------------- the five hooks
    def _load_graph(self, path: str, meta: GraphMeta) -> object:
        if meta.kind not in _KINDS:
            raise ValueError(f"mock executor: graph {meta.name!r} has unsupported kind {meta.kind!r}")
        return meta.name

    def _execute(self, graph_handle, device_inputs, device_outputs, meta: GraphMeta) -> None:
        t0 = time.perf_counter()
        ins = {s.name: self._view(device_inputs[s.name], s.shape, s.dtype) for s in meta.inputs}
        outs = {s.name: self._view(device_outputs[s.name], s.shape, s.dtype) for s in meta.outputs}
        _KINDS[meta.kind](self, meta, ins, outs)
        for fault in self.faults:
            fault.apply(meta, outs)
        # The simulated latency is the graph's whole device time: the mock's own arithmetic counts in it.
        remaining = self._latency_for(meta) / 1e3 - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)

    alloc_is_zeroed = True  # np.zeros: pages are zero-filled on first touch, never written twice

    def _alloc_device(self, nbytes: int) -> object:
        handle = next(self._ids)
        self._mem[handle] = np.zeros(nbytes, np.uint8)
        return handle

    def _free_device(self, device_buffer) -> None:
        self._mem.pop(device_buffer, None)

    # ---------------------------------------------------------------- helpers
    def _view(self, handle, shape, dtype) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return self._mem[handle][:n].view(dt).reshape(shape)

    def _latency_for(self, meta: GraphMeta) -> float:
        for key in (meta.name, meta.kind, meta.group):
            if key in self.latency_ms:
                return self.latency_ms[key]
        return 0.0

    def _embed(self, ids: np.ndarray, hidden: int) -> np.ndarray:
        if hidden not in self._embed_cache:
            rng = np.random.default_rng(hidden)
            self._embed_cache[hidden] = (rng.uniform(0.01, 0.5, hidden).astype(np.float32),
                                         rng.uniform(0, 2 * np.pi, hidden).astype(np.float32))
        freq, phase = self._embed_cache[hidden]
        return np.sin(ids.astype(np.float32)[:, None] * freq + phase)

    def _kv_entries(self, x: np.ndarray, positions: np.ndarray, kv_shape, dtype) -> np.ndarray:
        """KV entries [L, 2, KV, n, Dh] for token features x [n, H] at absolute positions."""
        L, _, KV, _, Dh = kv_shape
        n, H = x.shape
        idx = (np.arange(KV)[:, None] * Dh + np.arange(Dh)[None, :]) % H  # [KV, Dh]
        inv = 1.0 / (10000.0 ** (np.arange(Dh, dtype=np.float32) / Dh))
        pos = np.sin(positions.astype(np.float32)[:, None] * inv)  # [n, Dh]
        feat = np.tanh(x[:, idx] + pos[:, None, :])  # [n, KV, Dh]
        feat = feat.transpose(1, 0, 2)  # [KV, n, Dh]
        scale = (1.0 + 0.1 * np.arange(L, dtype=np.float32))[:, None] * np.array([1.0, -0.5], np.float32)
        return (scale[:, :, None, None, None] * feat[None, None]).astype(dtype)

    def _summary(self, k_last_layer: np.ndarray) -> np.ndarray:
        """Readout of a whole prefix: last layer's K entries [KV, p, Dh] -> [_SUMMARY]."""
        z = k_last_layer.astype(np.float32)
        mean = z.mean(axis=1).ravel()
        last = z[:, -1].ravel()
        s = np.concatenate([mean, last])
        idx = np.linspace(0, s.size - 1, _SUMMARY).astype(np.int64)
        return s[idx] * 3.0 + np.float32(z.shape[1]) * 1e-3

    def _wave(self, n: int, u: np.ndarray) -> np.ndarray:
        k = np.arange(n, dtype=np.float32)[:, None]
        return (np.sin(k * self._omega + u) * self._amp).sum(axis=1).astype(np.float32)

    def _prefix_readout(self, past: np.ndarray, cache_pos: int, new: np.ndarray | None) -> np.ndarray:
        """Summary over the cache below cache_pos followed by new entries (same bytes either way)."""
        k = past[-1, 0, :, :cache_pos]
        if new is not None:
            k = np.concatenate([k, new[-1, 0]], axis=1)
        return self._summary(k)


def _check_span(meta: GraphMeta, needed: int, past_len: int):
    bucket = meta.attrs.get("bucket", past_len)
    if needed > bucket:
        raise ValueError(f"{meta.name}: needs {needed} cache positions but the graph's span is {bucket}")


def _run_vision(ex: MockExecutor, meta, ins, outs):
    px = ins["pixel_values"]  # [T,3,th,tw]
    T, _, th, tw = px.shape
    n_tok = outs["vision_embeds"].shape[0] // T
    H = outs["vision_embeds"].shape[1]
    g = int(round(np.sqrt(n_tok)))
    gh, gw = (g, n_tok // g) if g * (n_tok // g) == n_tok else (1, n_tok)
    ph, pw = max(th // gh, 1), max(tw // gw, 1)
    crop = px[:, :, :gh * ph, :gw * pw].reshape(T, 3, gh, ph, gw, pw)
    means = crop.mean(axis=(3, 5)).transpose(0, 2, 3, 1).reshape(T * gh * gw, 3)  # [T*n_tok, 3]
    if H not in ex._vision_w:
        rng = np.random.default_rng(H + 7)
        ex._vision_w[H] = rng.normal(0, 1.0, (3, H)).astype(np.float32)
    tile_code = np.repeat(np.arange(T, dtype=np.float32), gh * gw)[:, None] * 0.01
    outs["vision_embeds"][...] = np.sin(means @ ex._vision_w[H] + tile_code)


def _run_embed(ex: MockExecutor, meta, ins, outs):
    ids = ins["input_ids"][0]
    outs["inputs_embeds"][0] = ex._embed(ids, outs["inputs_embeds"].shape[-1])


def _run_prefill(ex: MockExecutor, meta, ins, outs):
    past = ins["past_kv"]
    n, cp = int(ins["num_tokens"][0]), int(ins["cache_position"][0])
    b = ins["inputs_embeds"].shape[1]
    if not 1 <= n <= b:
        raise ValueError(f"{meta.name}: num_tokens {n} outside [1, {b}]")
    if cp < 0 or cp + n > past.shape[3]:
        raise ValueError(f"{meta.name}: cache_position {cp} + {n} tokens exceeds the cache ({past.shape[3]})")
    rows = ins["inputs_embeds"][0, :n]
    if "state" in ins:  # SmolVLA's prefix: the last row stands for the robot state (a stand-in for state_proj)
        rows = rows.copy()
        rows[-1] += np.float32(np.tanh(ins["state"].astype(np.float64).sum()))
    new = ex._kv_entries(rows, np.arange(cp, cp + n), past.shape, past.dtype)
    outs["new_kv"][...] = 0
    outs["new_kv"][:, :, :, :n] = new
    if "logits" in outs:  # a flow-matching VLA's prefill returns new_kv alone
        u = ex._prefix_readout(past, cp, new)
        outs["logits"][0] = ex._wave(outs["logits"].shape[1], u)


def _run_decode(ex: MockExecutor, meta, ins, outs):
    past = ins["past_kv"]
    cp = int(ins["cache_position"][0])
    _check_span(meta, cp + 1, past.shape[3])
    x = ex._embed(ins["input_ids"][0], _hidden_of(meta))
    new = ex._kv_entries(x, np.array([cp]), past.shape, past.dtype)
    outs["new_kv"][...] = new
    u = ex._prefix_readout(past, cp, new)
    outs["logits"][0] = ex._wave(outs["logits"].shape[1], u)


def _run_action_expert(ex: MockExecutor, meta, ins, outs):
    past = ins["past_kv"]
    p = int(ins["prefix_len"][0])
    if p < 1:
        raise ValueError(f"{meta.name}: prefix_len must be >= 1, got {p}")
    _check_span(meta, p, past.shape[3])
    x = ins["noisy_actions"]
    t = time_from_embedding(ins["time_embedding"])
    u = ex._prefix_readout(past, p, None)
    if "state" in ins:  # the robot state moves the target too (a stand-in for pi0's state token)
        u = u + np.float32(np.tanh(ins["state"].astype(np.float64).sum()))
    target = np.tanh(0.5 * ex._wave(x.size, u)).reshape(x.shape)
    # Exact velocity of the straight path from noise (t=1) to the prefix's target (t=0).
    outs["velocity"][...] = (x - target) / max(t, 1e-6)


def _run_action_expert_vjp(ex: MockExecutor, meta, ins, outs):
    """The mock expert's velocity and the exact Real-Time Chunking correction J^T e of x1 = x - s v(x): the
    mock's dv/dx is I / t, so J^T e = e - s e / t (about 0: its x1 is the target for any x)."""
    _run_action_expert(ex, meta, ins, outs)
    x, v, s = ins["noisy_actions"], outs["velocity"], ins["flow_time"].astype(np.float32)[0]
    e = (ins["target"] - (x - s * v)) * ins["weights"]
    outs["correction"][...] = e - s * e / max(time_from_embedding(ins["time_embedding"]), 1e-6)


def _run_features(ex: MockExecutor, meta, ins, outs):
    """GR00T's backbone: row i reads rows 0 .. i alone (causal), with their positions and DeepStack maps."""
    n = int(ins["num_tokens"][0])
    x = ins["inputs_embeds"][0]
    if not 1 <= n <= x.shape[0]:
        raise ValueError(f"{meta.name}: num_tokens {n} outside [1, {x.shape[0]}]")
    rows = x[:n].astype(np.float32)
    if "deepstack_embeds" in ins:
        rows = rows + ins["deepstack_embeds"][:, :n].sum(axis=0)
    rows = rows + np.float32(1e-3) * ins["position_ids"][:, :n].sum(axis=0)[:, None].astype(np.float32)
    outs["features"][...] = 0
    outs["features"][0, :n] = np.tanh(np.cumsum(rows, axis=0) / np.arange(1, n + 1, dtype=np.float32)[:, None])


def _run_vl_context(ex: MockExecutor, meta, ins, outs):
    """GR00T's once-per-frame context: a summary of the valid feature rows in every key/value, the text and image
    masks, the state's sum in the state features."""
    n = int(ins["num_tokens"][0])
    feats = ins["features"][0, :n]
    kv = outs["cross_kv"]
    flat = np.resize(np.concatenate([feats.mean(axis=0), feats[-1]]), kv.shape[2:])
    kv[...] = flat.astype(np.float32)
    image = ins["image_rows"][0] > 0.5
    valid = np.arange(image.size) < n
    outs["cross_bias"][0] = np.where(valid & ~image, 0.0, MASKED_SCORE)
    outs["cross_bias"][1] = np.where(valid & image, 0.0, MASKED_SCORE)
    outs["state_features"][...] = np.float32(np.tanh(ins["state"].astype(np.float64).sum()))


def _run_dit(ex: MockExecutor, meta, ins, outs):
    """GR00T's DiT: the exact velocity of the straight path from noise (t = 0) to a target that the context and
    the state features fix (t = timestep / time_buckets)."""
    kv, bias = ins["cross_kv"], ins["cross_bias"]
    visible = (bias > -1.0).any(axis=0)  # rows some block reads
    u = ex._summary(kv[0, 0][:, visible]) + np.float32(ins["state_features"].ravel()[0])
    x = ins["noisy_actions"]
    target = np.tanh(0.5 * ex._wave(x.size, u)).reshape(x.shape)
    t = float(ins["timestep"][0]) / float(meta.attrs.get("time_buckets", 1000))
    outs["velocity"][...] = (target - x) / max(1.0 - t, 1e-6)


def _run_dit_vjp(ex: MockExecutor, meta, ins, outs):
    """The mock DiT's velocity and the exact Real-Time Chunking correction J^T e of x1 = x + (1 - τ) v(x) at
    GR00T time τ (``flow_time``): the mock's dv/dx is -I / (1 - t), so J^T e = e - (1 - τ) e / (1 - t)."""
    _run_dit(ex, meta, ins, outs)
    x, v = ins["noisy_actions"], outs["velocity"]
    remaining = np.float32(1.0) - ins["flow_time"].astype(np.float32)[0]
    e = (ins["target"] - (x + remaining * v)) * ins["weights"]
    t = float(ins["timestep"][0]) / float(meta.attrs.get("time_buckets", 1000))
    outs["correction"][...] = e - remaining * e / np.float32(max(1.0 - t, 1e-6))


def _hidden_of(meta: GraphMeta) -> int:
    if "hidden_dim" not in meta.attrs:
        raise ValueError(f"mock executor: decode graph {meta.name!r} lacks attrs.hidden_dim")
    return int(meta.attrs["hidden_dim"])


_KINDS = {
    "vision_encoder": _run_vision,
    "embed": _run_embed,
    "prefill": _run_prefill,
    "decode": _run_decode,
    "action_expert": _run_action_expert,
    "action_expert_vjp": _run_action_expert_vjp,
    "features": _run_features,
    "vl_context": _run_vl_context,
    "dit": _run_dit,
    "dit_vjp": _run_dit_vjp,
}


def time_from_embedding(emb: np.ndarray) -> float:
    """t in [0, 1] back from a flow-time embedding (``model.time_embedding``): its lowest frequency,
    2*pi / TIME_MAX_PERIOD, turns less than pi over [0, 1]."""
    emb = np.asarray(emb, np.float64).reshape(-1)
    half = emb.size // 2
    return float(np.arctan2(emb[half - 1], emb[-1]) * TIME_MAX_PERIOD / (2.0 * np.pi))
