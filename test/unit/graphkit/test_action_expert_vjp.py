"""The action expert's Real-Time Chunking graph (action_expert_vjp_<d>, ``execution.rtc.guidance: vjp``): its
correction is torch autograd's vector-Jacobian product of x1 = x - t v(x) with the weighted error, in torch and
exported to ONNX, at any prefix length and flow time, and it reads the action expert's own weights."""
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


from checkpoints import weight_digests  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.graphkit.torch_models import build_graph_modules  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.model.normalization import PI05_PROMPT  # noqa: E402
from synflux_ros.model.time_embedding import time_embedding  # noqa: E402

torch.set_num_threads(2)
CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"


def tiny_pi0(guidance="vjp", kv_dtype="float16", architecture="gemma", state_dim=10, kv_heads=1, variant="pi0"):
    cfg = load_config(str(CONFIG_DIR / "vla_pi0.yaml"))
    if variant == "pi05":  # pi0.5: adaptive norms, the state in the prompt
        cfg = cfg.with_overrides(action={"time_conditioning": "adarms", "state_input": "prompt"},
                                 tokenizer={"prompt_template": PI05_PROMPT})
    elif variant == "smolvla":  # cross-attention layers, causal action tokens, the state in the prefix
        cfg = cfg.with_overrides(action={"state_input": "prefix", "expert_attention": "cross_attn",
                                         "action_attention": "causal"})
    return cfg.with_overrides(
        llm={"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "num_kv_heads": kv_heads, "head_dim": 16,
             "vocab_size": 512, "intermediate_size": 128, "prefill_buckets": [32], "decode_buckets": [48, 64],
             "max_seq_len": 64, "kv_dtype": kv_dtype, "architecture": architecture},
        vision={"tokens_per_tile": 16, "hidden_dim": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        action={"action_dim": 6, "action_horizon": 8, "expert_hidden_dim": 32, "expert_intermediate_size": 48,
                "state_dim": state_dim, **({} if state_dim else {"state_joints": []})},
        execution={"mode": "rtc", "rtc": {"guidance": guidance}})


def inputs_of(meta, rng, prefix_len, t):
    h = meta.inputs[0].shape[1]
    out = {}
    for spec in meta.inputs:
        if spec.name == "prefix_len":
            out[spec.name] = np.array([prefix_len], np.int64)
        elif spec.name == "time_embedding":
            out[spec.name] = time_embedding(t, spec.shape[-1])
        elif spec.name == "flow_time":
            out[spec.name] = np.array([t], np.float32)
        elif spec.name == "weights":
            out[spec.name] = np.r_[np.ones(2), np.linspace(1, 0, h - 3), [0]].astype(np.float32).reshape(1, h, 1)
        else:
            out[spec.name] = (2 * rng.standard_normal(spec.shape)).astype(spec.dtype)
    return out


FLOAT32_ULPS = 64
"""The graph module's explicit VJP and torch autograd's backward pass compute the same float32 function with
sums in other orders (and other orders again with other thread counts): they differed by up to 22 units in the
last place of the output's largest value (2.1e-5 on values near 7). 64 ulps leaves room for that, while a wrong
Jacobian term moves the correction by >= 0.05 (asserted below), over 10^4 ulps."""


def float32_ulps(reference: np.ndarray, n: int) -> float:
    """``n`` float32 units in the last place of the largest magnitude in ``reference``."""
    return n * float(np.spacing(np.float32(np.abs(reference).max())))


def autograd_correction(expert_graph, ins):
    """J^T e of x1 = x - t v(x), e = (target - x1) * weights, by torch autograd on the action_expert graph."""
    x = torch.from_numpy(ins["noisy_actions"]).requires_grad_(True)
    args = [torch.from_numpy(ins[k]) for k in ("time_embedding", "prefix_len", "past_kv")]
    state = [torch.from_numpy(ins["state"])] if "state" in ins else []
    with torch.enable_grad():
        (v,) = expert_graph(x, *args, *state)
        x1 = x - float(ins["flow_time"][0]) * v
        e = ((torch.from_numpy(ins["target"]) - x1) * torch.from_numpy(ins["weights"])).detach()
        (c,) = torch.autograd.grad(x1, x, e)
    return v.detach().numpy(), c.numpy(), e.numpy()


def test_the_vjp_graphs_come_with_the_vjp_guidance_only():
    names = {m.name for m in graph_set(tiny_pi0())}
    assert {"action_expert_vjp_48", "action_expert_vjp_64", "action_expert_48"} <= names
    assert not any("vjp" in m.name for m in graph_set(tiny_pi0("lerobot")))
    vjp = {m.name: m for m in graph_set(tiny_pi0())}["action_expert_vjp_48"]
    assert [t.name for t in vjp.inputs][-4:] == ["state", "target", "weights", "flow_time"]
    assert [t.name for t in vjp.outputs] == ["velocity", "correction"]


@pytest.mark.parametrize("kv_dtype,architecture,state_dim,kv_heads,variant", [
    ("float16", "gemma", 10, 1, "pi0"),  # pi0: unit-offset norms, tanh GELU, the state token
    ("float32", "qwen3", 0, 2, "pi0"),  # q/k norms, SiLU, grouped heads, no state token
    ("float32", "llama", 10, 4, "pi0"),
    ("float32", "qwen2", 10, 2, "pi0"),  # q/k/v biases
    ("float16", "gemma", 10, 1, "pi05"),  # pi0.5: adaptive norms and gated residuals, the state in the prompt
    ("float32", "llama", 10, 2, "smolvla"),  # cross-attention layers (no gradient through their keys), causal
])
def test_vjp_graph_is_autograd_through_the_expert_in_torch_and_onnx(kv_dtype, architecture, state_dim, kv_heads,
                                                                    variant, tmp_path):
    cfg = tiny_pi0(kv_dtype=kv_dtype, architecture=architecture, state_dim=state_dim, kv_heads=kv_heads,
                   variant=variant)
    gm = build_graph_modules(cfg, seed=3)
    metas = {m.name: m for m in graph_set(cfg)}
    rng = np.random.default_rng(0)
    meta = metas["action_expert_vjp_48"]
    module, expert = gm.modules[meta.name], gm.modules["action_expert_48"]
    with torch.no_grad():  # random weights make a nearly constant field; steeper layers make the Jacobian count
        for proj in (expert.expert.action_in_proj, expert.expert.action_out_proj):
            proj.weight.mul_(10.0)
        for layer in expert.expert.layers:  # Qwen2's biases are zero at init: make them count
            if layer.self_attn.qkv_b is not None:
                layer.self_attn.qkv_b.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        for m in expert.expert.modules():  # pi0.5's norm modulations: biases away from zero, so gates count
            if hasattr(m, "dense"):
                m.dense.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    model = build_tool.export_graph(module, meta, str(tmp_path))
    plain = build_tool.export_graph(expert, metas["action_expert_48"], str(tmp_path))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for prefix_len, t in ((5, 1.0), (30, 0.6), (48, 0.1)):
        ins = inputs_of(meta, rng, prefix_len, t)
        v, c, e = autograd_correction(expert, ins)
        assert np.abs(c - e).max() > 0.05  # the Jacobian of the expert counts
        with torch.no_grad():
            tv, tc = module(*[torch.from_numpy(ins[s.name]) for s in meta.inputs])
        np.testing.assert_allclose(tv.numpy(), v, atol=float32_ulps(v, FLOAT32_ULPS))
        np.testing.assert_allclose(tc.numpy(), c, atol=float32_ulps(c, FLOAT32_ULPS))
        feeds = {}
        for spec in meta.inputs:
            lead = graphset.VIEW_INPUTS.get(spec.name, 0)
            for idx in (graphset.view_indices(spec.shape, lead) if lead else [()]):
                feeds[graphset.view_name(spec.name, idx) if lead else spec.name] = ins[spec.name][idx]
        got_v, got_c = sess.run(None, feeds)
        np.testing.assert_allclose(got_v, v, atol=1e-4, err_msg=f"velocity at prefix {prefix_len}, t {t}")
        np.testing.assert_allclose(got_c, c, atol=1e-4, err_msg=f"correction at prefix {prefix_len}, t {t}")

    # the weights are the action expert's, so the graph set stores them once
    assert weight_digests(model) and weight_digests(model) <= weight_digests(plain)
