"""pi0 as LeRobot runs it, the parts that are not the checkpoint: the bidirectional prefix, several cameras per
frame, state normalisation / action un-normalisation with LeRobot's formulas, and the instruction's BOS and
length cut. (Parity with LeRobot itself on a saved checkpoint: parity/test_pi0_lerobot.py.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, NormalizationConfig, load_config
from synflux_ros.model.normalization import PI05_PROMPT, Normalizer, StateActionMaps
from synflux_ros.execution.robot_state import CameraImages, NoFreshState

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
JOINTS = ["j1", "j2", "j3"]


def demo(**sections):
    """vla_demo_orin (small, mock) as a pi0-style model: bidirectional prefix, state, the given overrides."""
    cfg = load_config(str(CONFIG_DIR / "vla_demo_orin.yaml"))
    base = {"llm": {"prefill_attention": "bidirectional"},
            "action": {"state_dim": 8, "state_joints": JOINTS}, "executor": {"backend": "mock"}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return cfg.with_overrides(**base)


# ------------------------------------------------------------------ config rules

def test_config_rules():
    cfg = demo(vision={"cameras": ["front", "wrist"]})
    assert cfg.vision.num_cameras == 2 and cfg.prefix_vision_tokens == 2 * cfg.vision.num_tokens
    # cameras, their skew and the normalisation shape no graph; the prefix attention does
    assert cfg.graph_hash() == demo().graph_hash()
    assert demo().graph_hash() != demo(llm={"prefill_attention": "causal"}).graph_hash()
    with pytest.raises(ConfigError, match="vision.cameras: names must be unique"):
        demo(vision={"cameras": ["front", "front"]})
    with pytest.raises(ConfigError, match="usable in a topic name"):
        demo(vision={"cameras": ["front cam"]})
    with pytest.raises(ConfigError, match="bidirectional prefixes are for vla configs"):
        load_config(str(CONFIG_DIR / "vlm_demo.yaml")).with_overrides(llm={"prefill_attention": "bidirectional"})
    with pytest.raises(ConfigError, match="must fit the largest bucket"):
        demo(vision={"cameras": ["a", "b", "c"]})
    with pytest.raises(ConfigError, match="output_dim: 40 exceeds action_dim"):
        demo(action={"output_dim": 40})
    dim = demo().action.action_dim
    with pytest.raises(ConfigError, match=f"action_norm: 2 dimensions, the published actions have {dim}"):
        demo(action={"action_norm": {"mode": "mean_std", "mean": [0, 0], "std": [1, 1]}})
    with pytest.raises(ConfigError, match="action.state_norm.low / high: mode bounds needs both"):
        demo(action={"state_norm": {"mode": "bounds", "low": [0, 0, 0]}})
    with pytest.raises(ConfigError, match="action.state_norm.mean / std: not used by mode bounds"):
        demo(action={"state_norm": {"mode": "bounds", "low": [0] * 3, "high": [1] * 3, "mean": [0] * 3}})
    with pytest.raises(ConfigError, match="state_norm: 2 dimensions for 3 state_joints"):
        demo(action={"state_norm": {"mode": "mean_std", "mean": [0, 0], "std": [1, 1]}})


# ------------------------------------------------------------------ normalisation

def test_normalisation_follows_lerobots_formulas():
    x = np.array([0.5, -2.0, 3.0], np.float32)
    ms = Normalizer(NormalizationConfig(mode="mean_std", mean=(1.0, 0.0, 2.0), std=(2.0, 0.5, 0.0)))
    # (x - mean) / (std + eps): a zero std divides by eps; back: y * std + mean (no eps)
    np.testing.assert_allclose(ms.forward(x)[:2], [(0.5 - 1.0) / (2.0 + 1e-8), -2.0 / (0.5 + 1e-8)], rtol=1e-6)
    assert ms.forward(x)[2] == np.float32(1.0) / np.float32(1e-8)
    np.testing.assert_allclose(ms.inverse(np.array([1.0, 2.0, 5.0], np.float32)), [3.0, 1.0, 2.0])
    b = Normalizer(NormalizationConfig(mode="bounds", low=(0.0, -1.0, 4.0), high=(2.0, 3.0, 4.0)))
    # 2 (x - low) / d - 1, d = high - low (eps where 0); back: (y + 1) d / 2 + low
    np.testing.assert_allclose(b.forward(x)[:2], [-0.5, -1.5])
    np.testing.assert_allclose(b.inverse(np.array([0.0, 1.0, 1.0], np.float32)), [1.0, 3.0, 4.0 + 1e-8])


def test_the_state_is_normalised_before_padding_and_actions_are_cut_before_unnormalising():
    cfg = demo(action={"output_dim": 2, "state_norm": {"mode": "mean_std", "mean": [1, 1, 1], "std": [2, 2, 2]},
                       "action_norm": {"mode": "bounds", "low": [0, 10], "high": [2, 20]}})
    maps = StateActionMaps(cfg.action)
    state = np.zeros(8, np.float32)
    state[:3] = [3.0, 1.0, -1.0]
    got = maps.state_in(state)
    np.testing.assert_allclose(got[:3], [1.0, 0.0, -1.0], rtol=1e-6)
    assert not got[3:].any()  # the padding stays zero (normalising it would move it to -mean/std)
    actions = np.tile(np.array([0.0, 1.0] + [7.0] * (cfg.action.action_dim - 2), np.float32), (4, 1))
    out = maps.actions_out(actions)
    assert out.shape == (4, 2)
    np.testing.assert_allclose(out[0], [1.0, 20.0])


# ------------------------------------------------------------------ cameras

def test_other_cameras_take_the_image_nearest_the_first_cameras_frame():
    cams = CameraImages(["front", "wrist", "top"], max_skew=0.05)
    img = {t: np.full((2, 2, 3), i, np.uint8) for i, t in enumerate([9.90, 10.00, 10.03])}
    for t, im in img.items():
        cams.add("wrist", t, im)
    cams.add("top", 10.04, img[10.03])
    first = np.zeros((2, 2, 3), np.uint8)
    got = cams.images_for(10.02, first)
    assert got[0] is first and got[1] is img[10.03] and got[2] is img[10.03]  # 10 ms after beats 20 ms before
    assert cams.images_for(10.01, first)[1] is img[10.00]
    cams.add("wrist", 10.13, first)
    with pytest.raises(NoFreshState, match="nearest 'top' image is 100 ms older than the frame "
                                           "\\(vision.camera_max_skew: 50 ms\\)"):
        cams.images_for(10.14, first)
    with pytest.raises(NoFreshState, match="no 'wrist' image received yet on 'wrist/image'"):
        CameraImages(["front", "wrist"], 0.05).images_for(1.0, first)


def test_the_runtime_runs_one_vision_call_per_camera_in_order():
    from synflux_ros.runtimes.vla import VLARuntime
    cfg = demo(vision={"cameras": ["front", "wrist"]})
    rt = VLARuntime(cfg)
    try:
        calls = []
        encode = rt.vision.encode
        rt.vision.encode = lambda px: calls.append(px) or encode(px)
        rng = np.random.default_rng(0)
        a, b = (rng.integers(0, 256, (120, 160, 3), np.uint8) for _ in range(2))
        state = np.zeros(8, np.float32)
        frame = rt.infer([a, b], state=state)
        assert len(calls) == 2 and frame.prefix_len == 2 * cfg.vision.num_tokens + len(rt._instruction.ids)
        np.testing.assert_array_equal(calls[0], rt.vision.preprocess(a))
        np.testing.assert_array_equal(calls[1], rt.vision.preprocess(b))
        with pytest.raises(ValueError, match="takes 2 camera image\\(s\\) per frame \\(front, wrist\\), got 1"):
            rt.infer(a, state=state)
    finally:
        rt.close()


def test_the_instruction_gets_its_bos_and_is_cut_like_lerobots_tokenizer():
    from synflux_ros.runtimes.vla import VLARuntime
    cfg = demo(tokenizer={"max_instruction_tokens": 6, "instruction_bos": "<|im_start|>"})
    rt = VLARuntime(cfg)
    try:
        rt.set_instruction("pick up the cup")
        bos = rt.tokenizer.special("<|im_start|>")
        assert list(rt._instruction.ids) == [bos] + list(b"pick ")
        rt.set_instruction("go")
        assert list(rt._instruction.ids) == [bos] + list(b"go\n")
    finally:
        rt.close()
    with pytest.raises(ConfigError, match="tokenizer.instruction_bos: the tokenizer has no special token '<bos>'"):
        VLARuntime(demo(tokenizer={"instruction_bos": "<bos>"}))


# ------------------------------------------------------------------ pi0.5: the state in the prompt

def pi05(**sections):
    """demo() as pi0.5 runs: adaptive-RMSNorm expert, the state (normalised to [-1, 1]) in the prompt."""
    base = {"action": {"time_conditioning": "adarms", "state_input": "prompt",
                       "state_norm": {"mode": "bounds", "low": [-2.0] * 3, "high": [2.0] * 3}},
            "tokenizer": {"prompt_template": PI05_PROMPT}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return demo(**base)


def test_the_state_is_written_as_pi05s_bins():
    from synflux_ros.model.normalization import state_prompt_text
    values = np.array([-1.5, -1.0, -0.99, 0.0, 0.5, 0.9921875, 0.999, 1.0, 3.0], np.float32)
    # LeRobot's Pi05PrepareStateTokenizerProcessorStep: np.digitize over linspace(-1, 1, 257)[:-1], minus one
    assert state_prompt_text(values) == "-1 0 1 128 192 255 255 255 255"
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.2, 1.2, 1000).astype(np.float32)
    edges = -1.0 + 2.0 * np.arange(256) / 256  # the bin edges written out
    assert state_prompt_text(x).split() == [str(int((v >= edges).sum()) - 1) for v in x]


def test_pi05_writes_each_frames_state_into_its_prompt():
    from synflux_ros.runtimes.vla import VLARuntime
    rt = VLARuntime(pi05())
    try:
        # kept as given (so a node or server sees it unchanged when it comes again); its prompt is cleaned as
        # LeRobot's pi0.5 step cleans a task
        rt.set_instruction("pick_up the\ncup")
        assert rt.instruction == "pick_up the\ncup" and len(rt._instruction.embeds) == 0  # embedded per frame
        embedded = []
        embed = rt.backbone.embed
        rt.backbone.embed = lambda ids: embedded.append(list(ids)) or embed(ids)
        image = np.zeros((64, 64, 3), np.uint8)
        state = np.array([2.0, 0.0, -2.0, 0, 0, 0, 0, 0], np.float32)  # bounds [-2, 2]: 1, 0, -1 normalised
        frame = rt.infer(image, state=state)
        text = "Task: pick up the cup, State: 255 128 0 128 128 128 128 128;\nAction: "
        assert embedded == [rt.tokenizer.encode(text)]
        assert frame.prefix_len == rt.vision_tokens + len(embedded[0]) and frame.actions.shape[0] > 0
        rt.infer(image, state=np.array([1.0, 0, 0, 0, 0, 0, 0, 0], np.float32))  # 0.5 normalised: bin 192
        assert embedded[1] == rt.tokenizer.encode(text.replace("255 128 0", "192 128 128"))
        with pytest.raises(ValueError, match=r"the prompt takes the robot state \(action.state_input: prompt\)"):
            rt.infer(image)
        with pytest.raises(ValueError, match="robot state: expected 8 finite values, got 8 with non-finite ones"):
            rt.infer(image, state=np.full(8, np.nan, np.float32))
    finally:
        rt.close()


def test_a_lerobot_05_prompt_writes_the_joints_alone():
    """action.prompt_state joints (checkpoints of LeRobot 0.5+): the state_joints values, not the padded vector."""
    from synflux_ros.runtimes.vla import VLARuntime
    cfg = pi05(action={"prompt_state": "joints"})
    rt = VLARuntime(cfg)
    try:
        joints = len(cfg.action.state_joints)
        assert 0 < joints < cfg.action.state_dim
        state = np.r_[np.full(joints, 2.0, np.float32), np.zeros(cfg.action.state_dim - joints, np.float32)]
        text = rt.tokenizer.decode(rt.prompt_ids("go", rt.maps.state_in(state))[len(rt.bos):])
        assert text == f"Task: go, State: {' '.join(['255'] * joints)};\nAction: "
    finally:
        rt.close()
    with pytest.raises(ConfigError, match="action.prompt_state: for a state written into the prompt"):
        demo(action={"prompt_state": "joints"})


def test_relative_actions_add_the_frames_state_where_the_mask_says():
    """action.relative_mask (LeRobot's use_relative_actions): the un-normalised chunk plus the frame's robot state
    where true; RTC, which steers towards the last chunk in model space, is refused with it (auto: replace)."""
    from synflux_ros.runtimes.vla import VLARuntime
    state = np.array([1.0, -2.0, 3.0, 0, 0, 0, 0, 0], np.float32)
    image = np.zeros((64, 64, 3), np.uint8)
    chunks = []
    for mask in ([True, False, True], []):
        rt = VLARuntime(demo(action={"output_dim": 3, "relative_mask": mask}))
        try:
            chunks.append(rt.infer(image, seq=4, state=state).actions)
        finally:
            rt.close()
    np.testing.assert_allclose(chunks[0] - chunks[1], np.broadcast_to([1.0, 0.0, 3.0], chunks[0].shape), atol=1e-6)
    cfg = demo(action={"output_dim": 3, "relative_mask": [True, False, True]})
    assert cfg.resolved_execution.mode == "replace" and demo().resolved_execution.mode == "rtc"
    with pytest.raises(ValueError, match="relative actions .* add the frame's robot state; none was given"):
        StateActionMaps(cfg.action).actions_out(np.zeros((4, 7), np.float32))
    with pytest.raises(ConfigError, match="execution.mode: rtc steers .* relative to each frame's state"):
        demo(action={"output_dim": 3, "relative_mask": [True, False, True]}, execution={"mode": "rtc"})
    with pytest.raises(ConfigError, match="action.relative_mask: 2 values for 3 published action values"):
        demo(action={"output_dim": 3, "relative_mask": [True, False]})
    with pytest.raises(ConfigError, match="the state has 3 joints for 7 actions"):
        demo(action={"relative_mask": [True] * 7})


def test_pi05_config_rules():
    assert pi05().action.state_token_dim == 0 and demo().action.state_token_dim == 8
    from synflux_ros.core.contract import graph_set
    expert = next(g for g in graph_set(pi05()) if g.kind == "action_expert")
    assert "state" not in {t.name for t in expert.inputs}  # no state token: the state is in the prompt
    with pytest.raises(ConfigError, match=r"tokenizer.prompt_template: \{state\} places the robot state"):
        pi05(tokenizer={"prompt_template": "{instruction}\n"})
    with pytest.raises(ConfigError, match=r"tokenizer.prompt_template: \{state\} places the robot state"):
        demo(tokenizer={"prompt_template": PI05_PROMPT})
    for execution in ({"mode": "rtc", "rtc": {"guidance": "vjp"}}, {"rtc": {"guidance": "vjp"}}):  # auto: rtc too
        names = {g.name for g in graph_set(pi05(execution=execution))}
        assert {f"action_expert_vjp_{d}" for d in pi05().llm.decode_buckets} <= names
    with pytest.raises(ConfigError, match="action.state_input: prompt writes the robot state into the prompt"):
        pi05(action={"state_dim": 0, "state_joints": [], "state_norm": None})


# ------------------------------------------------------------------ the bidirectional prefix in the graphs

def test_prefill_rows_see_every_valid_row_with_a_bidirectional_prefix_and_only_earlier_ones_when_causal():
    torch = pytest.importorskip("torch")
    from synflux_ros.graphkit.torch_models import build_graph_modules
    from synflux_ros.core.contract import graph_set

    def first_row_kv(cfg, embeds, n):
        meta = next(m for m in graph_set(cfg) if m.kind == "prefill")
        module = build_graph_modules(cfg, seed=0).modules[meta.name]
        p = meta.attrs["bucket"]
        x = torch.zeros(1, p, cfg.llm.hidden_dim)
        x[0, :embeds.shape[0]] = embeds
        kv = torch.zeros(cfg.llm.kv_shape)
        with torch.no_grad():
            new_kv = module(x, torch.tensor([n]), torch.tensor([0]), kv)[-1]  # pi0's prefill: new_kv alone
        return new_kv[:, :, :, 0]  # every layer's K/V of row 0

    gen = torch.Generator().manual_seed(0)
    h = demo().llm.hidden_dim
    a = torch.randn(6, h, generator=gen) * 0.05
    b = a.clone()
    b[4] += 0.5  # a later token changes
    c = a.clone()
    c[5] += 0.5  # a padded row (beyond num_tokens = 5) changes
    bidi, causal = demo(), demo(llm={"prefill_attention": "causal"})
    # layer 0's K/V come from the token alone; from layer 1 on row 0 has seen the later token iff bidirectional
    assert (first_row_kv(bidi, a, 5)[1:] - first_row_kv(bidi, b, 5)[1:]).abs().max() > 1e-4
    torch.testing.assert_close(first_row_kv(causal, a, 5), first_row_kv(causal, b, 5))
    torch.testing.assert_close(first_row_kv(bidi, a, 5), first_row_kv(bidi, c, 5))  # padding is never seen


def test_a_bidirectional_prefix_starts_the_cache(tmp_path):
    """The prefill graph of a bidirectional prefix attends among its rows alone: it reads none of the cache
    views it takes, and the backbone refuses to prefill such a prefix anywhere but at position 0."""
    from synflux_ros.core.contract import graph_set
    from synflux_ros.runtimes.vla import VLARuntime
    rt = VLARuntime(demo())
    try:
        slot = rt.kv_pool.acquire()
        embeds = np.zeros((4, rt.cfg.llm.hidden_dim), np.float32)
        with pytest.raises(ValueError, match=r"a bidirectional prefix \(llm.prefill_attention\) starts the cache: "
                                             r"prefill at position 0, not 3"):
            rt.backbone.prefill(rt.kv_pool.tensor(slot), 3, embeds)
        assert rt.backbone.prefill(rt.kv_pool.tensor(slot), 0, embeds) is None  # pi0's prefill: no logits
    finally:
        rt.close()
    pytest.importorskip("torch")
    from synflux_ros.buildtool import export as build_tool
    from synflux_ros.graphkit.torch_models import build_graph_modules
    cfg = demo()
    meta = next(m for m in graph_set(cfg) if m.kind == "prefill")
    model = build_tool.export_graph(build_graph_modules(cfg, seed=0).modules[meta.name], meta, str(tmp_path))
    views = [n for n, _, _ in build_tool.onnx_inputs(meta) if n.startswith("past_kv.")]
    assert views and [i.name for i in model.graph.input if i.name.startswith("past_kv.")] == views
    assert not {i for node in model.graph.node for i in node.input} & set(views)


# ------------------------------------------------------------------ SmolVLA: the state as the prefix's last row

def smolvla(**sections):
    """demo() as SmolVLA runs: the state projected into the prefix's last row, cross-attention expert layers,
    causal action tokens, mean/std state normalisation."""
    base = {"llm": {"architecture": "llama"},
            "action": {"state_input": "prefix", "expert_attention": "cross_attn", "action_attention": "causal",
                       "state_norm": {"mode": "mean_std", "mean": [1.0] * 3, "std": [2.0] * 3}}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return demo(**base)


def test_smolvla_config_rules():
    from synflux_ros.core.contract import graph_set
    cfg = smolvla()
    assert (cfg.action.prefix_state_dim, cfg.action.state_token_dim) == (8, 0)
    metas = graph_set(cfg)
    prefill = next(m for m in metas if m.kind == "prefill")
    expert = next(m for m in metas if m.kind == "action_expert")
    assert prefill.inputs[-1].name == "state" and prefill.inputs[-1].shape == (1, 8)
    assert "state" not in {t.name for t in expert.inputs}
    assert [cfg.action.cross_attention_layer(i) for i in range(4)] == [False, True, False, True]
    assert not any(demo().action.cross_attention_layer(i) for i in range(4))
    assert not any(smolvla(action={"self_attn_every_n_layers": 1}).action.cross_attention_layer(i) for i in range(4))
    assert all(smolvla(action={"self_attn_every_n_layers": 0}).action.cross_attention_layer(i) for i in range(4))
    assert len({smolvla().graph_hash(), demo().graph_hash(),
                smolvla(action={"action_attention": "bidirectional"}).graph_hash()}) == 3
    with pytest.raises(ConfigError, match="action.state_input: prefix projects the robot state into the prefix"):
        smolvla(action={"state_dim": 0, "state_joints": [], "state_norm": None})
    with pytest.raises(ConfigError, match="set llm.prefill_attention: bidirectional"):
        smolvla(llm={"prefill_attention": "causal"})
    with pytest.raises(ConfigError, match="cross_attn goes with time_conditioning action_mlp"):
        smolvla(action={"time_conditioning": "adarms"})
    with pytest.raises(ConfigError, match="causal action tokens with a state token"):
        demo(action={"action_attention": "causal"})
    with pytest.raises(ConfigError, match="cross_attn layers take the action tokens alone: not with a state token"):
        demo(action={"expert_attention": "cross_attn"})
    with pytest.raises(ConfigError, match="cross_attn layers are built for llama and gemma backbones .* not qwen3"):
        smolvla(llm={"architecture": "qwen3"})
    with pytest.raises(ConfigError, match="vision.token_merge: a vit option; qwen3_vl takes its own"):
        load_config(str(CONFIG_DIR / "vlm_qwen3.yaml")).with_overrides(vision={"token_merge": "pixel_shuffle"})
    with pytest.raises(ConfigError, match="for flow_matching heads only"):
        load_config(str(CONFIG_DIR / "vla_openvla.yaml")).with_overrides(action={"expert_attention": "cross_attn"})


def test_smolvla_prefix_ends_with_the_normalised_state():
    from synflux_ros.runtimes.vla import VLARuntime
    rt = VLARuntime(smolvla())
    try:
        rt.set_instruction("pick up the cube")
        calls = []
        prefill = rt.backbone.prefill
        rt.backbone.prefill = lambda slot, start, embeds, **kw: calls.append((embeds.copy(), kw)) or prefill(
            slot, start, embeds, **kw)
        image = np.zeros((64, 64, 3), np.uint8)
        frame = rt.infer(image, state=np.array([3.0, 1.0, -1.0, 0, 0, 0, 0, 0], np.float32))
        embeds, kw = calls[0]
        n_prompt = len(rt._instruction.ids)
        assert frame.prefix_len == embeds.shape[0] == rt.vision_tokens + n_prompt + 1
        assert not embeds[-1].any()  # the state's row: a placeholder the prefill graph fills
        np.testing.assert_allclose(kw["state"], [1.0, 0.0, -1.0, 0, 0, 0, 0, 0])  # (x - 1) / 2, padded with zeros
        with pytest.raises(ValueError, match=r"the prefix ends with the robot state \(action.state_input: prefix\)"):
            rt.infer(image)
        with pytest.raises(ValueError, match="robot state: expected 8 finite values, got 3"):
            rt.infer(image, state=np.ones(3, np.float32))
        slot = rt.kv_pool.acquire()
        with pytest.raises(ValueError, match="a vector of 8 values is needed, got none"):
            rt.backbone.prefill(rt.kv_pool.tensor(slot), 0, embeds)
        rt.kv_pool.release(slot)
        again = rt.infer(image, state=np.zeros(8, np.float32))  # still serving; the state reaches the (mock) model
        assert np.abs(again.actions - frame.actions).max() > 1e-6
    finally:
        rt.close()


def test_smolvla_prefill_graph_projects_the_state_into_a_row_only_it_sees():
    """The prefill graph's last valid row is state_proj(state); it attends to the whole prefix, while no other
    row attends to it: the state changes its own keys/values alone, and a prompt row changes the state row's."""
    torch = pytest.importorskip("torch")
    from synflux_ros.graphkit.torch_models import build_graph_modules
    from synflux_ros.core.contract import graph_set
    cfg = smolvla()
    meta = next(m for m in graph_set(cfg) if m.kind == "prefill")
    module = build_graph_modules(cfg, seed=0).modules[meta.name]
    p, n = meta.attrs["bucket"], 6
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(1, p, cfg.llm.hidden_dim)
    x[0, :n - 1] = torch.randn(n - 1, cfg.llm.hidden_dim, generator=gen) * 0.05
    state = torch.randn(1, 8, generator=gen)

    def kv(x, state):
        with torch.no_grad():
            return module(x, torch.tensor([n]), torch.tensor([0]), torch.zeros(cfg.llm.kv_shape), state)[-1]
    base = kv(x, state)
    other_state = kv(x, state + 1.0)
    torch.testing.assert_close(base[:, :, :, :n - 1], other_state[:, :, :, :n - 1])  # nobody sees the state
    assert (base[:, :, :, n - 1] - other_state[:, :, :, n - 1]).abs().max() > 1e-3
    with torch.no_grad():  # layer 0's key of the state row: its projection, whatever the placeholder held
        x_junk = x.clone()
        x_junk[0, n - 1] = 7.0
    torch.testing.assert_close(kv(x_junk, state), base)
    x2 = x.clone()
    x2[0, 2] += 0.5  # a prompt row changes: the state row (which sees it) changes from layer 1 on
    assert (kv(x2, state)[1:, :, :, n - 1] - base[1:, :, :, n - 1]).abs().max() > 1e-4
