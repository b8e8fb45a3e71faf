"""Load-time rewrite of the portable decoder graphs into ONNX Runtime's fused CPU kernels (the onnxruntime
executor's ``fusions`` option): RMSNorm, residual add + RMSNorm, the rotary embedding and attention, with
onnxscript's pattern rewriter and rules of this module where our graphs' forms differ from what onnxscript's
rules expect. A decode graph's attention then appends to the KV slot in place (``graphset.IN_PLACE_SUFFIX``,
``graphset.ROWS_IN_PLACE``). :func:`fused_graph_set` caches the rewritten set. Needs ``onnxscript`` (and
``onnx``), imported on first use; what each rule does and why: docs/backends/onnxruntime.md#fusions.
"""
from __future__ import annotations

import os
import shutil
from typing import NamedTuple

import numpy as np

from ...core.config import choices_hint
from ...graphset import cache, reader as graphset

FUSIONS = ("rms_norm", "skip_rms_norm", "rotary", "attention", "padded_keys")
"""The rewrites this module knows, in the order they are applied."""
DEFAULT_FUSIONS = ("rms_norm", "rotary", "attention", "padded_keys")
"""What ``fusions: true`` applies (``skip_rms_norm`` gains nothing for decoding: docs/backends/onnxruntime.md)."""
CACHE_KEY = "ort_fusions"
"""Manifest key of a fused set's fingerprint."""
_MIN_OPSET = 18
_INSTALL_HINT = "pip install onnxscript"


def _onnxscript():
    try:
        import onnxscript  # noqa: F401
        from onnxscript import rewriter  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"onnxruntime executor: the fusions option needs the 'onnxscript' package "
                           f"({_INSTALL_HINT}), or set fusions: false") from exc
    return onnxscript


def parse(value) -> tuple[str, ...]:
    """The ``fusions`` option (true, false or a list of :data:`FUSIONS` names) -> the fusions to apply."""
    if value is False or value is None:
        return ()
    if value is True:
        return DEFAULT_FUSIONS
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        unknown = [v for v in value if v not in FUSIONS]
        if unknown:
            raise ValueError(f"onnxruntime executor: executor.options.fusions: unknown fusion {unknown[0]!r}"
                             f"{choices_hint(unknown[0], FUSIONS)}")
        return tuple(f for f in FUSIONS if f in value)
    raise ValueError(f"onnxruntime executor: executor.options.fusions: expected true, false or a list of "
                     f"{', '.join(FUSIONS)}, got {value!r}")


def versions() -> dict:
    """What a fused set depends on besides its source: onnxscript, onnx (its opset converter) and this module.
    Read from the installed packages' metadata: loading a fused set that is up to date imports neither (their
    modules would add some 70 MB to the process)."""
    from importlib import metadata

    found = {}
    for package in ("onnxscript", "onnx"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError as exc:
            raise RuntimeError(f"onnxruntime executor: the fusions option needs the 'onnxscript' package "
                               f"({_INSTALL_HINT}), or set fusions: false") from exc
    return {**found, "rules": cache.digest([__file__], length=16)}


# ---------------------------------------------------------------------------------------------- helpers
def _const(value):
    """numpy value of a constant (initializer or Constant node output) or None."""
    from onnxscript.rewriter import _ir_utils

    return _ir_utils.get_numpy_value(value)


def _ints(value) -> list[int] | None:
    v = _const(value)
    return None if v is None or v.dtype.kind not in "iu" else [int(x) for x in v.reshape(-1)]


def _static_shape(value) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def _is_float32(*values) -> bool:
    import onnx_ir as ir

    return all(v is not None and v.dtype == ir.DataType.FLOAT for v in values)


def _producer(value, op_type: str):
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _attr(node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _graph_input(value) -> bool:
    return value is not None and value.producer() is None and value.is_graph_input()


class _InPlace(NamedTuple):
    """A GroupQueryAttention that appends its new row to the KV views in place (``_kv_in_place`` finishes it)."""
    view_k: object
    view_v: object
    present_k: object
    present_v: object
    k: object
    """The new keys [KV, 1, Dh] the graph computed (its new_kv output reads them)."""
    v: object
    row: object
    """int64 [1]: the cache row the new entries go to."""
    packed: bool


def _through_row_reshapes(value):
    """The tensor ``value`` is a reshape of: back through Reshape, Unsqueeze, Squeeze and through Transposes that
    keep the memory order (the axes longer than 1 stay in order; a single row's heads moved around it)."""
    while True:
        node = value.producer() if value is not None else None
        if node is None or node.domain != "":
            return value
        if node.op_type == "Transpose":  # output axis i is input axis perm[i]
            shape, perm = _static_shape(node.outputs[0]), _attr(node, "perm")
            if shape is None or perm is None:
                return value
            long_axes = [p for i, p in enumerate(perm) if shape[i] != 1]
            if long_axes != sorted(long_axes):
                return value
        elif node.op_type not in ("Reshape", "Unsqueeze", "Squeeze"):
            return value
        value = node.inputs[0]


def _slice_ints(node):
    """``(starts, ends, axes, steps)`` of a Slice node as int lists (None where an input is absent or not a
    constant; absent steps are ones)."""
    starts, ends, axes, steps = (list(node.inputs[1:]) + [None] * 4)[:4]
    starts = _ints(starts)
    ones = None if starts is None else [1] * len(starts)
    return starts, _ints(ends), _ints(axes) if axes is not None else None, ones if steps is None else _ints(steps)


def _cache_views(past_k, past_v):
    """The graph inputs (KV slot views [KV, S, Dh]) that ``past_k``/``past_v`` are, whole or as their first
    positions (``Slice`` along the position axis: a decode graph of span d < S), when attention is their only
    reader; else None."""
    views = []
    for past in (past_k, past_v):
        if len(past.uses()) != 1:
            return None
        view = past
        sl = _producer(past, "Slice")
        if sl is not None:
            view = sl.inputs[0]
            starts, _, axes, steps = _slice_ints(sl)
            if starts != [0] or axes not in ([1], [-2]) or steps != [1] or len(view.uses()) != 1:
                return None
        shape = _static_shape(view)
        if not _graph_input(view) or shape is None or len(shape) != 3:
            return None
        views.append(view)
    return tuple(views) if _static_shape(views[0]) == _static_shape(views[1]) else None


def _packed_rotary_qkv(q, k, v, nh: int, kv: int, dh: int, cache_position, length: int):
    """``(qkv, cos, sin)`` when one new row's q [nh, 1, Dh], k, v [kv, 1, Dh] are the column blocks of one product
    ``qkv`` [1, (nh + 2 kv) Dh] (q, k, v in that order), q and k rotated by com.microsoft.RotaryEmbedding over
    the same half tables at the position ``cache_position`` (clamped to the table), so that GroupQueryAttention
    can take ``qkv`` packed and rotate it itself (``do_rotary``; it rotates at the row it writes, the same
    position for cache positions below ``length``). None otherwise."""
    def column_block(value, start, stop):
        source = _producer(_through_row_reshapes(value), "Slice")
        if source is None:
            return None
        x = source.inputs[0]
        starts, end, axes, steps = _slice_ints(source)
        shape = _static_shape(x)
        if shape != (1, (nh + 2 * kv) * dh) or not _is_float32(x) or starts != [start] or \
                axes not in ([1], [-1]) or steps != [1]:
            return None
        if end is None or len(end) != 1 or not (end[0] == stop or (stop == shape[1] and end[0] > stop)):
            return None
        return x

    def rotary(value):
        node = _through_row_reshapes(value).producer()
        if node is None or node.op_type != "RotaryEmbedding" or node.domain != "com.microsoft":
            return None
        if _attr(node, "interleaved", 0) or _attr(node, "is_packed_batching", 0) or \
                _attr(node, "rotary_embedding_dim", 0) not in (0, dh) or _attr(node, "scale", 1.0) != 1.0:
            return None
        return node

    if dh % 16:  # GQA's rotary needs a head size that is a multiple of 16
        return None
    rq, rk = rotary(q), rotary(k)
    if rq is None or rk is None or list(rq.inputs[2:4]) != list(rk.inputs[2:4]):
        return None
    pos, cos, sin = rq.inputs[1:4]
    source = _through_row_reshapes(pos)
    if _through_row_reshapes(rk.inputs[1]) is not source:
        return None
    clip = _producer(source, "Clip")
    if clip is not None:
        bounds = [_const(x) if x is not None else None for x in (list(clip.inputs[1:]) + [None, None])[:2]]
        if any(b is None or b.size != 1 for b in bounds) or bounds[0].reshape(-1)[0] > 0 or \
                bounds[1].reshape(-1)[0] < length - 1:
            return None
        source = clip.inputs[0]
    if source is not cache_position:  # (the int64 graph input the mask compares with)
        return None
    for table in (cos, sin):
        value = _const(table)
        if value is None or value.dtype != np.float32 or value.shape != (value.shape[0], dh // 2) or \
                value.shape[0] < length:
            return None
    blocks = [column_block(rq.inputs[0], 0, nh * dh), column_block(rk.inputs[0], nh * dh, (nh + kv) * dh),
              column_block(v, (nh + kv) * dh, (nh + 2 * kv) * dh)]
    if blocks[0] is None or any(b is not blocks[0] for b in blocks):
        return None
    return blocks[0], cos, sin


def _kv_in_place(model, records) -> tuple[int, int]:
    """Finish the in-place GroupQueryAttentions: each KV view becomes a [1, KV, S, Dh] input read by GQA
    directly, GQA's present outputs become graph outputs named ``<view>`` + :data:`graphset.IN_PLACE_SUFFIX`
    (the executor binds them to the view's memory, so GQA sees one buffer and writes only the new row), and
    where GQA rotates the keys itself the graph's new K/V entries are read back from that row. Returns
    ``(attentions made in place, of which taking Q/K/V packed)``."""
    import onnx_ir as ir

    graph = model.graph
    for rec in records:
        gqa = rec.present_k.producer()
        for index, view, present in ((3, rec.view_k, rec.present_k), (4, rec.view_v, rec.present_v)):
            unsqueeze = gqa.inputs[index].producer()
            readers = {id(node) for node, _ in view.uses()}
            if readers != {id(unsqueeze)}:
                raise AssertionError(f"{view.name}: read by other nodes than its attention")
            view.shape = ir.Shape([1, *view.shape])
            gqa.replace_input_with(index, view)
            present.name = view.name + graphset.IN_PLACE_SUFFIX
            present.shape, present.dtype = view.shape, view.dtype
            graph.outputs.append(present)
        # the graph's new entries (read by its new_kv output): the row GQA wrote, [1, KV, 1, Dh] -> [KV, 1, Dh];
        # where GQA rotates the keys itself, nothing else computes them any more
        kv, dh = rec.view_k.shape[1], rec.view_k.shape[3]
        shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([kv, 1, dh], np.int64))})
        graph.append(shape)
        feeding = _feeding(gqa)
        for new, present in ((rec.k, rec.present_k), (rec.v, rec.present_v)):
            gather = ir.node("Gather", [present, rec.row], attributes={"axis": 2})
            reshape = ir.node("Reshape", [gather.outputs[0], shape.outputs[0]])
            graph.extend([gather, reshape])
            for node, index in list(new.uses()):
                if id(node) not in feeding:
                    node.replace_input_with(index, reshape.outputs[0])
    if records:
        _leave_out_rows(graph, {id(v) for r in records for v in (r.present_k, r.present_v)})
        graph.sort()
    return len(records), sum(r.packed for r in records)


def _feeding(node) -> set[int]:
    """ids of the nodes that ``node`` depends on."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        for value in stack.pop().inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and id(producer) not in seen:
                seen.add(id(producer))
                stack.append(producer)
    return seen


def _leave_out_rows(graph, presents: set[int]) -> bool:
    """A one-row graph whose every layer's new entries are rows GQA wrote into the slot: its ``new_kv`` output
    [L, 2, KV, 1, Dh], exported as ``stack(stack(k_l, v_l) for each layer l)`` of the [KV, 1, Dh] entries
    (Concats of Unsqueezes, two per layer), is then the slot's row at ``cache_position``. The output is left
    out (``graphset.ROWS_IN_PLACE``; the executor reads the row from the slot) and its chain goes with the
    unused nodes. ``presents``: ids of the GQA present outputs (the in-place views). True if left out."""
    out = next((v for v in graph.outputs if v.name == "new_kv"), None)
    shape = _static_shape(out) if out is not None else None
    if shape is None or len(shape) != 5 or shape[1] != 2 or shape[3] != 1:
        return False

    def parts(value, count):  # the inputs of ``value`` = Concat(axis 0) of ``count`` reshaped tensors
        concat = _producer(_through_row_reshapes(value), "Concat")
        if concat is None or _attr(concat, "axis") != 0 or len(concat.inputs) != count:
            return None
        return [_through_row_reshapes(x) for x in concat.inputs]

    rows = []
    for layer in parts(out, shape[0]) or []:
        for entry in parts(layer, 2) or []:
            gather = _producer(entry, "Gather")  # through the Reshape to [KV, 1, Dh]: the [1, KV, 1, Dh] row
            if gather is None or _attr(gather, "axis") != 2 or id(gather.inputs[0]) not in presents:
                return False
            rows.append(gather.outputs[0])
    if len(rows) != 2 * shape[0]:
        return False
    graph.outputs.remove(out)
    return True


# ---------------------------------------------------------------------------------------------- rules
def _rules():
    """The rule classes (defined on first use so that importing this module needs no onnxscript)."""
    import onnx_ir as ir
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions import skip_normalization

    class ReciprocalOfDivision(pattern.RewriteRuleClassBase):
        """``Div(1, x)`` -> ``Reciprocal(x)`` (the same float operation), the form of ``1 / rms`` that
        onnxscript's RMSNorm rule matches; torch exports ``rsqrt`` as ``Div(1, Sqrt(.))``."""

        def pattern(self, op, one, x):
            return op.Div(one, x)

        def check(self, context, one, x, **_):
            result = pattern.MatchResult()
            v = _const(one)
            if v is None or v.size != 1 or v.dtype != np.float32 or float(v.reshape(-1)[0]) != 1.0:
                return result.fail("numerator is not the float32 constant 1")
            return result

        def rewrite(self, op, x, **_):
            return op.Reciprocal(x)

    class SkipRmsNorm(skip_normalization.SkipRmsNormFusion):
        """onnxscript's SkipSimplifiedLayerNormalization rule; its check wants [batch, tokens, hidden]
        activations, the decoder's are [tokens, hidden] (which the ORT kernel takes as well)."""

        def check(self, context, input, skip, gamma, bias, simplified_layer_norm, **_):
            result = pattern.MatchResult()
            shapes = [_static_shape(v) for v in (input, skip)]
            g = _static_shape(gamma)
            if any(s is None or len(s) not in (2, 3) for s in shapes) or shapes[0] != shapes[1]:
                return result.fail("input and skip are not [tokens, hidden] or [batch, tokens, hidden] alike")
            if g is None or g != shapes[0][-1:]:
                return result.fail("gamma is not [hidden]")
            if self._has_bias and _static_shape(bias) != g:
                return result.fail("bias is not [hidden]")
            if simplified_layer_norm.producer().attributes.get_int("stash_type", 1) != 1:
                return result.fail("stash_type is not float")
            return result

    class TableRotaryEmbedding(pattern.RewriteRuleClassBase):
        """Rotate-half RoPE with cos/sin rows looked up in a table:

            x * Gather(cos_table, pos) + Concat(-x[..., h:], x[..., :h]) * Gather(sin_table, pos)

        (``decoder.apply_rope`` on ``decoder.rope_lookup``; x [heads, T, Dh], tables [N, Dh] whose two halves
        are equal, as ``rope_table`` makes them) -> ``com.microsoft.RotaryEmbedding`` over the table's first
        half. Constant cos/sin [T, Dh] (rows the exporter folded, e.g. for SmolVLA's cross-attention queries at
        fixed positions) become a table of their own T rows, read at positions 0 .. T-1. When x is
        ``Transpose(y, [1, 0, 2])`` of y [T, heads, Dh] the kernel reads y as [1, T, heads*Dh] (no transposes
        around it); otherwise x as [1, heads, T, Dh]."""

        def __init__(self):
            super().__init__("TableRotaryEmbedding")
            self._halves: dict[str, tuple] = {}

        def setup(self):
            self._halves = {}

        def pattern(self, op, x, cos, sin, hi_start, hi_end, hi_axes, hi_steps, lo_start, lo_end, lo_axes, lo_steps):
            hi = op.Slice(x, hi_start, hi_end, hi_axes, hi_steps)
            lo = op.Slice(x, lo_start, lo_end, lo_axes, lo_steps)
            rotated = op.Concat(op.Neg(hi), lo, axis=-1)
            return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

        def check(self, context, x, cos, sin, hi_start, hi_end, hi_axes, hi_steps, lo_start, lo_end, lo_axes,
                  lo_steps, **_):
            result = pattern.MatchResult()
            shape = _static_shape(x)
            if not _is_float32(x, cos, sin) or shape is None or len(shape) != 3:
                return result.fail("x is not a float32 [heads, T, Dh] tensor")
            heads, t, dh = shape
            half = dh // 2
            if dh % 2:
                return result.fail("odd head size")
            for axes, steps in ((hi_axes, hi_steps), (lo_axes, lo_steps)):
                if _ints(axes) not in ([2], [-1]) or _ints(steps) != [1]:
                    return result.fail("the halves are not sliced along the last axis")
            if _ints(hi_start) != [half] or (_ints(hi_end) or [0])[0] < dh or _ints(lo_start) != [0] \
                    or _ints(lo_end) != [half]:
                return result.fail("x is not split into two halves")
            gathers = [_producer(v, "Gather") for v in (cos, sin)]
            if gathers == [None, None]:  # rows folded into constants (SmolVLA's cross-attention queries): a
                for v in (cos, sin):     # table of those T rows, read at positions 0 .. T-1
                    value = _const(v)
                    if value is None or value.shape != (t, dh) or value.dtype != np.float32:
                        return result.fail("cos/sin are neither gathered from a table nor float32 [T, Dh] constants")
                    if not np.array_equal(value[:, :half], value[:, half:]):
                        return result.fail("the constant's two halves differ (not a rotate-half table)")
                    self._halves.setdefault(v.name, (np.ascontiguousarray(value[:, :half]), None))
                return result
            if None in gathers or any(_attr(g, "axis", 0) != 0 for g in gathers):
                return result.fail("cos/sin are not rows gathered from a table")
            if gathers[0].inputs[1] is not gathers[1].inputs[1]:
                return result.fail("cos and sin are gathered at different positions")
            pos = gathers[0].inputs[1]
            if pos.dtype != ir.DataType.INT64 or _static_shape(pos) != (t,):
                return result.fail("positions are not int64 [T]")
            for g in gathers:
                table = g.inputs[0]
                value = _const(table)
                if value is None or value.ndim != 2 or value.shape[1] != dh or value.dtype != np.float32:
                    return result.fail("the table is not a float32 [N, Dh] constant")
                if table.name not in self._halves:
                    if not np.array_equal(value[:, :half], value[:, half:]):
                        return result.fail("the table's two halves differ (not a rotate-half table)")
                    self._halves[table.name] = (np.ascontiguousarray(value[:, :half]), None)
            return result

        def _half(self, op, table):
            array, made = self._halves[table.name]
            if made is None:
                made = op.initializer(ir.tensor(array), name=f"{table.name}.half")
                self._halves[table.name] = (array, made)
            return made

        def rewrite(self, op, x, cos, sin, **_):
            heads, t, dh = _static_shape(x)
            g_cos, g_sin = _producer(cos, "Gather"), _producer(sin, "Gather")
            if g_cos is None:  # the constant rows as a table, row i for x's row i
                pos = op.Constant(value=ir.tensor(np.arange(t, dtype=np.int64)[None, :]))
                cos_half, sin_half = self._half(op, cos), self._half(op, sin)
            else:
                pos = op.Unsqueeze(g_cos.inputs[1], op.Constant(value_ints=[0]))
                cos_half, sin_half = self._half(op, g_cos.inputs[0]), self._half(op, g_sin.inputs[0])
            source = _producer(x, "Transpose")
            if source is not None and list(_attr(source, "perm", [])) == [1, 0, 2] and \
                    _static_shape(source.inputs[0]) == (t, heads, dh):
                flat = op.Reshape(source.inputs[0], op.Constant(value_ints=[1, t, heads * dh]))
                y = op.RotaryEmbedding(flat, pos, cos_half, sin_half, interleaved=0, num_heads=heads,
                                       _domain="com.microsoft")
                y = op.Reshape(y, op.Constant(value_ints=[t, heads, dh]))
                return op.Transpose(y, perm=[1, 0, 2])
            y = op.RotaryEmbedding(op.Unsqueeze(x, op.Constant(value_ints=[0])), pos, cos_half, sin_half,
                                   interleaved=0, _domain="com.microsoft")
            return op.Squeeze(y, op.Constant(value_ints=[0]))

    class CacheAttention(pattern.RewriteRuleClassBase):
        """``decoder.attend_past_and_new`` + the head merge of ``Attention.output`` ->
        ``com.microsoft.GroupQueryAttention``::

            qg = Reshape(q [nh, T, Dh], [KV, G, T, Dh])
            scores = Concat(qg @ past_k^T, qg @ k^T) * scale          # past_k/v [KV, S, Dh], k/v [KV, T, Dh]
            probs = Softmax(scores + Where(allowed, 0, -inf))          # decoder.attention_bias
            ctx = probs[..., :S] @ past_v + probs[..., S:] @ v
            out = Reshape(Transpose(Reshape(ctx, [nh, T, Dh]), [1, 0, 2]), [T, nh * Dh])

        where ``allowed`` [T, S + T] is the mask the graph modules build: cache position j < cache_position,
        and causal among the T new rows. GQA takes the cache as its past (``seqlens_k`` = past length + T - 1
        with the past length ``clip(cache_position, 0, S)``, the positions the mask allows), causal
        attention among the new rows, and the same scale."""

        def __init__(self, in_place: list):
            super().__init__("CacheAttention")
            self.in_place = in_place  # an _InPlace per in-place rewrite, for _kv_in_place

        def pattern(self, op, q, past_k, past_v, k, v, qg_shape, ax_pk, ax_k, ax_pv, ax_v, scale, bias,
                    p_start, p_end, p_axes, p_steps, n_start, n_end, n_axes, n_steps, ctx_shape, flat_shape):
            qg = op.Reshape(q, qg_shape, _allow_other_attributes=True)
            s_past = op.MatMul(qg, op.Transpose(op.Unsqueeze(past_k, ax_pk), perm=[0, 1, 3, 2]))
            s_new = op.MatMul(qg, op.Transpose(op.Unsqueeze(k, ax_k), perm=[0, 1, 3, 2]))
            scores = op.Mul(op.Concat(s_past, s_new, axis=-1), scale)
            probs = op.Softmax(op.Add(scores, bias), axis=-1)
            ctx = op.Add(op.MatMul(op.Slice(probs, p_start, p_end, p_axes, p_steps), op.Unsqueeze(past_v, ax_pv)),
                         op.MatMul(op.Slice(probs, n_start, n_end, n_axes, n_steps), op.Unsqueeze(v, ax_v)))
            ctx = op.Reshape(ctx, ctx_shape, _allow_other_attributes=True)
            return op.Reshape(op.Transpose(ctx, perm=[1, 0, 2]), flat_shape, _allow_other_attributes=True)

        def check(self, context, q, past_k, past_v, k, v, qg_shape, ax_pk, ax_k, ax_pv, ax_v, scale, bias,
                  p_start, p_end, p_axes, p_steps, n_start, n_end, n_axes, n_steps, ctx_shape, flat_shape, **_):
            result = pattern.MatchResult()
            if not _is_float32(q, past_k, past_v, k, v):
                return result.fail("attention is not float32 (GQA needs the cache in the query's type)")
            qs, ks, vs, pks, pvs = (_static_shape(t) for t in (q, k, v, past_k, past_v))
            if None in (qs, ks, vs, pks, pvs) or len(qs) != 3:
                return result.fail("shapes are not static [heads, tokens, head size]")
            nh, t, dh = qs
            kv, s = pks[0], pks[1]
            if ks != (kv, t, dh) or vs != (kv, t, dh) or pks != (kv, s, dh) or pvs != (kv, s, dh) or nh % kv:
                return result.fail("q/k/v/past shapes do not fit grouped-query attention")
            if _ints(qg_shape) != [kv, nh // kv, t, dh] or _ints(ctx_shape) != [nh, t, dh] or \
                    _ints(flat_shape) != [t, nh * dh]:
                return result.fail("head reshapes differ")
            if any(_ints(a) != [1] for a in (ax_pk, ax_k, ax_pv, ax_v)):
                return result.fail("unexpected unsqueeze axes")
            for axes, steps in ((p_axes, p_steps), (n_axes, n_steps)):
                if _ints(axes) not in ([3], [-1]) or _ints(steps) != [1]:
                    return result.fail("probabilities are not sliced along the key axis")
            if _ints(p_start) != [0] or _ints(p_end) != [s] or _ints(n_start) != [s] or \
                    (_ints(n_end) or [0])[0] < s + t:
                return result.fail("probabilities are not split at the cache length")
            found = _scale_and_mask(scale, bias)
            if isinstance(found, str):
                return result.fail(found)
            sc, allowed = found
            cache_position = _allowed_cache_position(allowed, s, t)
            if cache_position is None:
                return result.fail("the mask is not 'position < cache_position, causal among new rows'")
            views = _cache_views(past_k, past_v) if t == 1 else None
            packed = _packed_rotary_qkv(q, k, v, nh, kv, dh, cache_position,
                                        _static_shape(views[0])[1]) if views else None
            self._match = (cache_position, sc, nh, kv, t, dh, s, views, packed)
            return result

        def rewrite(self, op, q, past_k, past_v, k, v, **_):
            cache_position, scale, nh, kv, t, dh, s, views, packed = self._match

            def const(values):
                return op.Constant(value=ir.tensor(np.asarray(values, np.int64)))

            def tokens_major(x, heads):  # [heads, T, Dh] -> [1, T, heads * Dh]
                source = _producer(x, "Transpose")
                if source is not None and list(_attr(source, "perm", [])) == [1, 0, 2]:
                    x = source.inputs[0]  # already [T, heads, Dh]
                else:
                    x = op.Transpose(x, perm=[1, 0, 2])
                return op.Reshape(x, const([1, t, heads * dh]))

            if views is None:
                past = op.Clip(cache_position, const(0), const(s))
                seqlens = op.Cast(op.Add(past, const([t - 1])), to=ir.DataType.INT32)
                # the buffer length (ORT's "dynamic cache": present = past buffer + new rows), whatever the
                # position: padded prefill rows may pass the end of the past buffer
                total = op.Constant(value=ir.tensor(np.array(s + t, np.int32)))
                out, _, _ = op.GroupQueryAttention(
                    tokens_major(q, nh), tokens_major(k, kv), tokens_major(v, kv),
                    op.Unsqueeze(past_k, const([0])), op.Unsqueeze(past_v, const([0])), seqlens, total,
                    num_heads=nh, kv_num_heads=kv, scale=scale, _domain="com.microsoft", _outputs=3)
                return op.Reshape(out, const([t, nh * dh]))
            # one new row, the cache given as the KV slot's own views: GQA appends the row to the views in place
            # (its present outputs are bound to the views' memory; see _kv_in_place)
            view_k, view_v = views
            length = _static_shape(view_k)[1]
            row = op.Clip(cache_position, const(0), const(length - 1))  # in the buffer whatever the input
            seqlens = op.Cast(row, to=ir.DataType.INT32)
            total = op.Constant(value=ir.tensor(np.array(length, np.int32)))
            past = op.Unsqueeze(view_k, const([0])), op.Unsqueeze(view_v, const([0]))
            if packed is not None:  # Q, K, V as the one product's columns; the rotary inside GQA
                qkv, cos, sin = packed
                out, present_k, present_v = op.GroupQueryAttention(
                    op.Reshape(qkv, const([1, 1, (nh + 2 * kv) * dh])), None, None, *past, seqlens, total, cos, sin,
                    num_heads=nh, kv_num_heads=kv, scale=scale, do_rotary=1, rotary_interleaved=0,
                    _domain="com.microsoft", _outputs=3)
            else:
                out, present_k, present_v = op.GroupQueryAttention(
                    tokens_major(q, nh), tokens_major(k, kv), tokens_major(v, kv), *past, seqlens, total,
                    num_heads=nh, kv_num_heads=kv, scale=scale, _domain="com.microsoft", _outputs=3)
            self.in_place.append(_InPlace(view_k, view_v, present_k, present_v, k, v, row, packed is not None))
            return op.Reshape(out, const([t, nh * dh]))

    class PaddedKeysAttention(pattern.RewriteRuleClassBase):
        """``decoder.attend`` whose mask only cuts the keys at a length -> the same attention over the keys up to
        that length, with no mask where nothing else is masked::

            probs = Softmax(MatMul(qg, Transpose(Unsqueeze(keys, 1))) * scale + Where(allowed, 0, -inf))
            out = MatMul(probs, Unsqueeze(values, 1))

        with ``allowed`` [T, S] = key position < n (a prefix's padded bucket: ``num_tokens``; SmolVLA's
        cross-attention to the cache: ``prefix_len``), or [T, S + m] = that for the cached keys, joined to a
        constant mask of m new keys (the action expert: ``keys = Concat(past_k, k)``). ``n`` is an int64 [1]
        graph input. The keys (the cached ones in the joint form) are sliced to ``clip(n, ., S)``, so the
        padded keys are neither multiplied nor masked: onnxruntime's softmax is several times slower on rows
        holding masked (-inf) scores, and a short prompt in a long bucket masks most of them. What the new keys'
        mask allows stays as it was (the state token's and causal rows keep their bias)."""

        def __init__(self):
            super().__init__("PaddedKeysAttention")

        def pattern(self, op, qg, keys, values, ax_k, ax_v, scale, bias):
            scores = op.MatMul(qg, op.Transpose(op.Unsqueeze(keys, ax_k), perm=[0, 1, 3, 2]))
            probs = op.Softmax(op.Add(op.Mul(scores, scale), bias), axis=-1)
            return op.MatMul(probs, op.Unsqueeze(values, ax_v))

        def check(self, context, qg, keys, values, ax_k, ax_v, scale, bias, **_):
            result = pattern.MatchResult()
            if not _is_float32(qg, keys, values):
                return result.fail("attention is not float32")
            ks, vs, qs = _static_shape(keys), _static_shape(values), _static_shape(qg)
            if None in (ks, vs, qs) or len(ks) != 3 or len(vs) != 3 or len(qs) != 4 or ks[:2] != vs[:2]:
                return result.fail("keys/values are not static [KV, S, Dh]")
            if _ints(ax_k) != [1] or _ints(ax_v) != [1]:
                return result.fail("unexpected unsqueeze axes")
            found = _scale_and_mask(scale, bias)
            if isinstance(found, str):
                return result.fail(found)
            sc, allowed = found
            rows = qs[2]
            joined = _producer(allowed, "Concat")
            own = None
            if joined is not None:  # [cached keys < n | the new keys' constant mask]
                if len(joined.inputs) != 2 or _attr(joined, "axis") not in (1, -1):
                    return result.fail("the mask joins more than the cached and the new keys")
                allowed, own = joined.inputs[0], _const(joined.inputs[1])
                parts = [_producer(t, "Concat") for t in (keys, values)]
                if None in parts or any(len(p.inputs) != 2 or _attr(p, "axis") not in (1, -2) for p in parts):
                    return result.fail("a joined mask without keys/values joined from the cache and the new rows")
                cached = [_static_shape(p.inputs[0]) for p in parts]
                if None in cached or cached[0][0] != ks[0] or cached[1][0] != vs[0]:
                    return result.fail("the cached keys/values are not static [KV, S, Dh]")
                span, m = cached[0][1], ks[1] - cached[0][1]
                if cached[1][1] != span or own is None or own.dtype != np.bool_ or own.shape != (rows, m):
                    return result.fail("the new keys' mask is not a bool [T, new keys] constant")
            else:
                span, parts = ks[1], None
            expand = _producer(allowed, "Expand")
            if expand is not None:
                allowed = expand.inputs[0]
            less = _producer(allowed, "Less")
            if less is None:
                return result.fail("the mask is not 'key position < n'")
            positions, n = less.inputs
            r = _const(positions)
            if r is None or r.dtype.kind not in "iu" or r.reshape(-1).shape != (span,) or r.ndim > 2 or \
                    not np.array_equal(r.reshape(-1), np.arange(span)):
                return result.fail("the mask's positions are not 0 .. S-1")
            if not _graph_input(n) or n.dtype != ir.DataType.INT64 or _static_shape(n) != (1,):
                return result.fail("the key count is not an int64 [1] graph input")
            self._match = (n, span, sc, parts, own)
            return result

        def rewrite(self, op, qg, keys, values, **_):
            n, span, scale, parts, own = self._match

            def const(values, dtype=np.int64):
                return op.Constant(value=ir.tensor(np.asarray(values, dtype)))

            # with no new keys a query needs one key to attend to, as the mask's callers guarantee
            length = op.Clip(n, const([0 if parts is not None else 1]), const([span]))

            def first(t):
                return op.Slice(t, const([0]), length, const([1]))

            bias = None
            if parts is None:
                keys, values = first(keys), first(values)
            else:
                keys = op.Concat(first(parts[0].inputs[0]), parts[0].inputs[1], axis=1)
                values = op.Concat(first(parts[1].inputs[0]), parts[1].inputs[1], axis=1)
                if not own.all():  # the new keys' own mask stays: zeros for the cached keys, then it
                    rows = own.shape[0]
                    zeros = op.Expand(const([[0.0]], np.float32), op.Concat(const([rows]), length, axis=0))
                    bias = op.Concat(zeros, const(np.where(own, 0.0, -np.inf), np.float32), axis=1)
            scores = op.Mul(op.MatMul(qg, op.Transpose(op.Unsqueeze(keys, const([1])), perm=[0, 1, 3, 2])),
                            const(scale, np.float32))
            if bias is not None:
                scores = op.Add(scores, bias)
            return op.MatMul(op.Softmax(scores, axis=-1), op.Unsqueeze(values, const([1])))

    return ReciprocalOfDivision, SkipRmsNorm, TableRotaryEmbedding, CacheAttention, PaddedKeysAttention


def _scale_and_mask(scale, bias):
    """``(scale, allowed)`` of attention scores ``* scale + bias`` with a constant scale and ``bias =
    Where(allowed, 0, -inf)`` (``decoder.attention_bias``; ``allowed`` without a cast to bool), or a str
    saying what differs."""
    import onnx_ir as ir

    sc = _const(scale)
    if sc is None or sc.size != 1:
        return "scale is not a constant"
    where = _producer(bias, "Where")
    if where is None or len(where.inputs) != 3:
        return "the scores' mask is not Where(allowed, 0, -inf)"
    zero, ng = _const(where.inputs[1]), _const(where.inputs[2])
    if zero is None or zero.size != 1 or zero.reshape(-1)[0] != 0 or ng is None or ng.size != 1 or \
            not np.isneginf(ng.reshape(-1)[0]):
        return "the scores' mask is not Where(allowed, 0, -inf)"
    allowed = where.inputs[0]
    cast = _producer(allowed, "Cast")
    if cast is not None:
        if _attr(cast, "to") != ir.DataType.BOOL:
            return "the mask is cast to something other than bool"
        allowed = cast.inputs[0]
    return float(sc.reshape(-1)[0]), allowed


def _allowed_cache_position(allowed, s: int, t: int):
    """The int64 [1] graph input ``cache_position`` if ``allowed`` [T, S + T] (a cast to bool taken off, see
    :func:`_scale_and_mask`) is built as the graph modules build it: ``Concat(Less(arange(S)[None], cache_position) (expanded to T
    rows), tril(ones(T, T)), axis=1)``. None otherwise."""
    import onnx_ir as ir

    concat = _producer(allowed, "Concat")
    if concat is None or len(concat.inputs) != 2 or _attr(concat, "axis") not in (1, -1):
        return None
    past_ok, causal = concat.inputs
    tril = _const(causal)
    if tril is None or tril.dtype != np.bool_ or tril.shape != (t, t) or \
            not np.array_equal(tril, np.tril(np.ones((t, t), np.bool_))):
        return None
    expand = _producer(past_ok, "Expand")
    if expand is not None:  # [1, S] row repeated for the T new rows (the Concat fixes its shape to [T, S])
        past_ok = expand.inputs[0]
    elif t != 1:
        return None
    less = _producer(past_ok, "Less")
    if less is None:
        return None
    positions, cache_position = less.inputs
    r = _const(positions)
    if r is None or r.dtype.kind not in "iu" or r.shape != (1, s) or not np.array_equal(r[0], np.arange(s)):
        return None
    if not _graph_input(cache_position) or cache_position.dtype != ir.DataType.INT64 or \
            _static_shape(cache_position) != (1,):
        return None
    return cache_position


# ---------------------------------------------------------------------------------------------- rewriting
def fuse_model(path: str, fusions=DEFAULT_FUSIONS):
    """Rewrite the graph file ``path`` (its weights stay in the external data files beside it; they are
    read only where a rule checks a table). Returns ``(onnx.ModelProto, {fusion: count})``; external
    initializers keep their references (relative to the file's directory), new ones are in memory."""
    _onnxscript()
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.rewriter import RewriteRuleSet
    from onnxscript.rewriter.ort_fusions import rms_normalization
    from onnxscript.rewriter.rules.common import _basic_rules

    reciprocal, skip_rms, rotary, attention, padded_keys = _rules()
    proto = onnx.load(path, load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < _MIN_OPSET:  # onnx's converter: ReduceMean/Split/... take their axes as inputs from opset 18
        proto = onnx.version_converter.convert_version(proto, _MIN_OPSET)
    model = ir.from_proto(proto)
    del proto
    ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    common_passes.ShapeInferencePass()(model)

    counts = {}
    if "rms_norm" in fusions or "skip_rms_norm" in fusions:
        RewriteRuleSet([reciprocal.rule()]).apply_to_model(model)
        for node in model.graph:  # the rule spells out this default attribute (0: no axes = reduce all)
            if node.op_type == "ReduceMean" and node.domain == "" and "noop_with_empty_axes" not in node.attributes:
                node.attributes["noop_with_empty_axes"] = ir.AttrInt64("noop_with_empty_axes", 0)
        counts["rms_norm"] = rms_normalization.rms_normalization_ruleset.apply_to_model(model)
    if "skip_rms_norm" in fusions:
        rules = [skip_rms.rule("SkipRmsNormPreBias", has_bias=True, bias_pre_add=True),
                 skip_rms.rule("SkipRmsNormBias", has_bias=True, bias_pre_add=False),
                 skip_rms.rule("SkipRmsNorm", has_bias=False)]
        counts["skip_rms_norm"] = RewriteRuleSet(rules).apply_to_model(model)
    if "rotary" in fusions:
        counts["rotary"] = RewriteRuleSet([rotary.rule()]).apply_to_model(model)
    if "attention" in fusions:
        in_place: list[_InPlace] = []
        counts["attention"] = RewriteRuleSet([attention.rule(in_place)]).apply_to_model(model)
        common_passes.RemoveUnusedNodesPass()(model)  # the matched nodes' leftovers (a view's Slice)
        if in_place:
            counts["kv_in_place"], counts["packed_qkv"] = _kv_in_place(model, in_place)
    if "padded_keys" in fusions:
        sliced = RewriteRuleSet([padded_keys.rule()]).apply_to_model(model)
        if sliced:  # (decoder graphs attend causally: recorded where it applies)
            counts["padded_keys"] = sliced
    if "rms_norm" not in fusions and counts.get("rms_norm"):
        counts.pop("rms_norm")  # only the precursor of skip_rms_norm
    if not any(counts.values()):
        return onnx.load(path, load_external_data=False), counts  # nothing to fuse: the file as it is
    # reshapes of reshapes around the new kernels become one (onnxscript's rule); the per-layer copies of
    # the sequence lengths collapse into one
    RewriteRuleSet([_basic_rules.reshape_reshape_rule]).apply_to_model(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    common_passes.RemoveUnusedNodesPass()(model)
    if any(n.domain == "com.microsoft" for n in model.graph) and "com.microsoft" not in model.opset_imports:
        model.opset_imports["com.microsoft"] = 1
    out = ir.to_proto(model)
    del out.graph.value_info[:]  # inferred shapes of the source; ORT infers its own
    return out, counts


def count_ops(model) -> dict[str, int]:
    """``{op_type: count}`` of an ``onnx.ModelProto``'s main graph (domain-qualified for non-ONNX ops)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------- cache
def fingerprint(graph_dir: str, paths: dict[str, str], manifest: dict, fusions) -> dict:
    """What a fused set is keyed by: the fusions, :func:`versions` and the source files (size, mtime)."""
    return {"fusions": list(fusions), **versions(), **cache.source_fingerprint(graph_dir, manifest, paths)}


def fused_graph_set(graph_dir: str, metas, paths: dict[str, str], cache_dir: str, fusions) -> str:
    """Directory of the fused copy of a graph set (``<cache_dir>/<model>-fused-<digest>``), written when
    missing or stale. ``metas``: the GraphMeta of every graph to load; ``paths``: name -> source file.
    Its manifest holds the graph metas, the rewrite counts per graph (``fusion_counts``) and the
    fingerprint (:data:`CACHE_KEY`). Writing one removes the fused sets it supersedes
    (:func:`~synflux_ros.graphset.cache.prune_cache`)."""
    from ...graphset import writer as graphset_writer
    from ...core.contract import GraphMeta

    manifest = graphset.read_manifest(graph_dir)
    key = fingerprint(graph_dir, paths, manifest, fusions)
    target = cache.entry_dir(cache_dir, manifest, key, "fused")
    names = [m.name for m in metas]
    if cache.cached_copy_valid(target, CACHE_KEY, key, names):
        return target
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(f"onnxruntime executor: cannot write the fused graphs to {cache_dir} ({exc}); set "
                           f"optimized_model_dir to a writable directory") from exc
    work = f"{target}.partial-{os.getpid()}"
    counts = {}

    class _Fused:  # name -> fused ModelProto, made on access (one model in memory at a time)
        def items(self):
            for name in names:
                model, counts[name] = fuse_model(paths[name], fusions)
                yield name, model

        def __iter__(self):
            return iter(names)

    try:
        info = graphset_writer.write_weights_and_models(_Fused(), work, base_dir=graph_dir)
        # the weight format (dtype, block, scheme, carried GGUF blocks) stays what the source set says
        info = {**{k: v for k, v in (manifest.get("weights") or {}).items() if k not in info}, **info}
        fused_metas = [GraphMeta(m.name, m.kind, m.inputs, m.outputs, m.group, f"{m.name}.onnx", dict(m.attrs))
                       for m in metas]
        graphset_writer.write_manifest(work, fused_metas, info, model=manifest.get("model", ""),
                                       config_hash=manifest.get("config_hash", ""), fusion_counts=counts,
                                       **{CACHE_KEY: key})
        cache.publish_directory(work, target, lambda d: cache.cached_copy_valid(d, CACHE_KEY, key, names))
        cache.prune_cache(cache_dir, CACHE_KEY, key, target, versions=("onnxscript", "onnx", "rules"))
    finally:
        if os.path.isdir(work):
            shutil.rmtree(work, ignore_errors=True)
    return target
