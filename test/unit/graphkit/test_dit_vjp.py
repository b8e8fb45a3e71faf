"""GR00T's Real-Time Chunking graph (dit_vjp_<p>, ``execution.rtc.guidance: vjp``): its correction is torch
autograd's vector-Jacobian product of x1 = x + (1 - τ) v(x) with the weighted error, in torch and exported to
ONNX, at any time, and it reads the DiT's own weights."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


from checkpoints import weight_digests  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.core.config import from_dict  # noqa: E402
from synflux_ros.core.contract import MASKED_SCORE, graph_set  # noqa: E402
from synflux_ros.graphkit.torch_models import build_graph_modules  # noqa: E402

torch.set_num_threads(2)
JOINTS = ["a", "b", "c", "d", "e", "f", "g"]


def tiny_groot(text_every: int = 1):
    return from_dict({
        "name": "groot-vjp", "mode": "vla",
        "vision": dict(resolution=[64, 64], tile_size=[64, 64], tokens_per_tile=4, architecture="qwen3_vl",
                       patch_size=16, hidden_dim=32, num_layers=1, num_heads=2, intermediate_size=64,
                       spatial_merge_size=2, deepstack_layers=[0], cameras=["base"]),
        "llm": dict(num_layers=1, hidden_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512,
                    prefill_buckets=[32], decode_buckets=[32], max_seq_len=32, architecture="qwen3",
                    mrope_section=[4, 2, 2], tie_word_embeddings=True),
        "action": dict(head_type="flow_matching", expert_type="dit", action_dim=12, action_horizon=8,
                       num_denoise_steps=4, dit_layers=4, dit_heads=2, dit_head_dim=16, dit_hidden_dim=48,
                       dit_text_every_n_blocks=text_every, vl_layers=1, vl_heads=4, vl_head_dim=16, embodiment=1,
                       num_embodiments=2, state_dim=10, state_joints=JOINTS, output_dim=6),
        "execution": {"mode": "rtc", "rtc": {"guidance": "vjp"}},
        "executor": {"backend": "mock"}})


def inputs_of(meta, rng, tau: float) -> dict:
    out = {}
    for spec in meta.inputs:
        if spec.name == "flow_time":
            out[spec.name] = np.array([tau], np.float32)
        elif spec.name == "timestep":
            out[spec.name] = np.array([int(tau * 1000)], np.float32)
        elif spec.name == "weights":
            h = spec.shape[1]
            out[spec.name] = np.r_[np.ones(2), np.linspace(1, 0, h - 3), [0]].astype(np.float32).reshape(1, h, 1)
        elif spec.name == "cross_bias":  # text rows 0..9, image rows 10..19, the rest padding
            bias = np.full(spec.shape, MASKED_SCORE, np.float32)
            bias[0, :10], bias[1, 10:20] = 0.0, 0.0
            out[spec.name] = bias
        else:
            out[spec.name] = rng.standard_normal(spec.shape).astype(np.float32)
    return out


def autograd_correction(dit_graph, ins):
    """J^T e of x1 = x + (1 - τ) v(x), e = (target - x1) * weights, by torch autograd on the dit graph."""
    x = torch.from_numpy(ins["noisy_actions"]).requires_grad_(True)
    rest = [torch.from_numpy(ins[k]) for k in ("timestep", "state_features", "cross_kv", "cross_bias")]
    with torch.enable_grad():
        (v,) = dit_graph(x, *rest)
        x1 = x + (1.0 - float(ins["flow_time"][0])) * v
        e = ((torch.from_numpy(ins["target"]) - x1) * torch.from_numpy(ins["weights"])).detach()
        (c,) = torch.autograd.grad(x1, x, e)
    return v.detach().numpy(), c.numpy(), e.numpy()


@pytest.mark.parametrize("text_every", [1, 2])
def test_dit_vjp_graph_is_autograd_through_the_dit_in_torch_and_onnx(text_every, tmp_path):
    cfg = tiny_groot(text_every)
    gm = build_graph_modules(cfg, seed=3)
    metas = {m.name: m for m in graph_set(cfg)}
    meta = metas["dit_vjp_32"]
    module, dit = gm.modules["dit_vjp_32"], gm.modules["dit_32"]
    head = dit.head
    with torch.no_grad():  # random weights make a nearly constant field; steeper encoders make the Jacobian count
        enc, dec = head.action_encoder, head.action_decoder
        for linear in (enc.W1, enc.W2, enc.W3, dec.layer1, dec.layer2):
            linear.W.mul_(8.0)
        head.model.proj_out_2.weight.mul_(8.0)
        g = torch.Generator().manual_seed(1)
        for block in head.model.transformer_blocks:  # time modulations and biases away from zero
            block.norm1.linear.bias.normal_(0.0, 0.5, generator=g)
            block.attn1.to_q.bias.normal_(0.0, 0.5, generator=g)
    model = build_tool.export_graph(module, meta, str(tmp_path))
    plain = build_tool.export_graph(dit, metas["dit_32"], str(tmp_path))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for tau in (0.0, 0.5, 0.75):
        ins = inputs_of(meta, rng, tau)
        v, c, e = autograd_correction(dit, ins)
        assert np.abs(c - e).max() > 0.05  # the Jacobian of the DiT counts
        with torch.no_grad():
            tv, tc = module(*[torch.from_numpy(ins[s.name]) for s in meta.inputs])
        np.testing.assert_allclose(tv.numpy(), v, rtol=0, atol=2e-5 * max(1.0, np.abs(v).max()))
        np.testing.assert_allclose(tc.numpy(), c, rtol=0, atol=2e-5 * max(1.0, np.abs(c).max()))
        got_v, got_c = sess.run(None, {s.name: ins[s.name] for s in meta.inputs})
        np.testing.assert_allclose(got_v, v, atol=1e-4, err_msg=f"velocity at τ {tau}")
        np.testing.assert_allclose(got_c, c, atol=1e-4, err_msg=f"correction at τ {tau}")

    # the weights are the DiT's, so the graph set stores them once
    assert weight_digests(model) and weight_digests(model) <= weight_digests(plain)
