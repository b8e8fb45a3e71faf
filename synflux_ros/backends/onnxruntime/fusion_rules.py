"""The rewrite rules of the onnxruntime executor's load-time fusions (:mod:`.fusions`), with the graph
matching they share and the in-place KV rewrite that follows attention's: onnxscript pattern rules where our
graphs' forms differ from what onnxscript's own rules expect. Imports onnxscript, so :func:`.fusions.fuse_model`
imports this module only when fusions are enabled; what each rule does and why:
docs/backends/onnxruntime.md#fusions.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import skip_normalization

from ...graphset import reader as graphset

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


class InPlace(NamedTuple):
    """A GroupQueryAttention that appends its new row to the KV views in place (``kv_in_place`` finishes it)."""
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


def kv_in_place(model, records) -> tuple[int, int]:
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
        self.in_place = in_place  # an InPlace per in-place rewrite, for kv_in_place

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
        # (its present outputs are bound to the views' memory; see kv_in_place)
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
        self.in_place.append(InPlace(view_k, view_v, present_k, present_v, k, v, row, packed is not None))
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
