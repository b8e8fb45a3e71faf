"""Give each weight one layout per QNN graph: a load-time rewrite of graphs whose products read a weight in two roles.

The QNN provider turns a product with a constant operand into an HTP op whose weight tensor has one layout
(``MatMul(x, W)`` becomes FullyConnected with W stored transposed; ``Gemm(x, W, transB=1)`` keeps W as it is)
and registers that tensor under the initializer's name. A second product reading the same initializer in
another role gets the first one's tensor: refused where the shapes differ, the transposed values where W is
square. The vjp guidance's graph (``action_expert_vjp_<d>``) is such a graph: its backward pass multiplies by
the transposes of the weights its forward pass multiplies by. The file keeps each weight once; this rewrite
makes every later reader in another role read ``Transpose(W)`` instead (onnxruntime folds it into a private
copy when the session is created), with the product rewritten to give the same result:

* ``MatMul(W, B)`` -> ``Transpose(MatMul(Transpose(B), Transpose(W)))``;
* ``MatMul(A, W)`` -> ``Transpose(MatMul(Transpose(W), Transpose(A)))``

(2-D operands; the weight on the side where onnxruntime fuses no transpose into the product: a ``Gemm`` with
``Transpose(W)`` gets it folded back into ``transB``, reading W again). A ``Gemm`` reading a weight in a
second role is left as it is, and so is a product of an operand of another rank: QNN refuses them by name.
"""
from __future__ import annotations


def _role(node, index: int) -> tuple:
    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0) if node.op_type == "Gemm" else 0
    return node.op_type, index, trans_b


def private_weights(model) -> list[str]:
    """Rewrite ``model`` (an onnx ModelProto, changed in place) as the module docstring says; returns the names
    of the product nodes rewritten."""
    from onnx import helper, shape_inference

    graph = model.graph
    weights = {t.name: len(t.dims) for t in graph.initializer}
    first: dict[str, tuple] = {}
    later = []  # (position, weight's input index): products reading a weight in another role than its first reader
    for position, node in enumerate(graph.node):
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        index = next((i for i, name in enumerate(node.input[:2]) if weights.get(name) == 2), None)
        if index is not None and first.setdefault(node.input[index], _role(node, index)) != _role(node, index) \
                and node.op_type == "MatMul":
            later.append((position, index))
    if not later:  # most graphs: nothing to infer shapes for
        return []
    inferred = shape_inference.infer_shapes(model).graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in list(inferred.input) + list(inferred.value_info)}
    rewrite = {position: index for position, index in later
               if ranks.get(graph.node[position].input[1 - index]) == 2}
    out_nodes, rewritten = [], []
    for position, node in enumerate(graph.node):
        if position not in rewrite:
            out_nodes.append(node)
            continue
        index = rewrite[position]
        w, other = node.input[index], node.input[1 - index]
        tag = node.name or node.output[0]
        wt, ot, prod = f"{tag}/private_weight", f"{tag}/operand_t", f"{tag}/product_t"
        # W @ B = (Bᵀ @ Wᵀ)ᵀ and A @ W = (Wᵀ @ Aᵀ)ᵀ: the private copy Wᵀ is the other operand of the product
        pair = [ot, wt] if index == 0 else [wt, ot]
        out_nodes += [helper.make_node("Transpose", [w], [wt], name=wt, perm=[1, 0]),
                      helper.make_node("Transpose", [other], [ot], name=ot, perm=[1, 0]),
                      helper.make_node("MatMul", pair, [prod], name=f"{tag}/private"),
                      helper.make_node("Transpose", [prod], list(node.output), name=f"{tag}/result", perm=[1, 0])]
        rewritten.append(tag)
    if rewritten:
        del graph.node[:]
        graph.node.extend(out_nodes)
    return rewritten
