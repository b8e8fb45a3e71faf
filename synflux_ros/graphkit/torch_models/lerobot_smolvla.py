"""LeRobot SmolVLA checkpoints (``synflux-build --from-hf DIR`` on a directory whose config.json says
``"type": "smolvla"``): dimensions, cameras, state/action sizes and normalisation into a :class:`ModelConfig`,
and the weights into the graph modules.

SmolVLA is SmolVLM2's vision tower and first ``num_vlm_layers`` Llama layers with an action expert of 0.75 its
width. The vision tokens come from a pixel shuffle and a bias-free projector, scaled by sqrt(width)
(``vision.token_merge: pixel_shuffle``, ``projector_bias``, ``output_scale``); the language embeddings are
scaled the same (``llm.embed_scale``); the normalised state is projected into the prefix's last row
(``action.state_input: prefix``); every other expert layer cross-attends to the prefix through its own k/v
projections of the cached keys and values (``action.expert_attention: cross_attn``; LeRobot's ``attention_mode:
self_attn`` makes every layer attend jointly); action tokens are causal.
RoPE has base 10000 whatever SmolVLM's config says (LeRobot's own rotary code). Images are padded at the top
and left (``vision.resize: letterbox_bottom_right``). The SmolVLM2 tokenizer is not part of the checkpoint:
give ``tokenizer.path`` or put tokenizer.json beside it. docs/internals/build.md has the mapping.
"""
from __future__ import annotations

import math

from ...core.config import ConfigError, ModelConfig
from ...core.contract import TIME_MAX_PERIOD, TIME_MIN_PERIOD
from .checkpoint import copy_checked, read_config
from .lerobot_pi0 import (
    _EXPORT_LAYOUT, _key, _layers, _need, _norm, _shapes, _vision_names, lerobot_policy_type, state_joints)

ROOT = "vlm_with_expert."
VLM = ROOT + "vlm.model."
VISION = VLM + "vision_model."
CONNECTOR = VLM + "connector.modality_projection.proj.weight"
TEXT = VLM + "text_model."
LM_HEAD = ROOT + "vlm.lm_head.weight"
EXPERT = ROOT + "lm_expert."
_PROJECTIONS = ("action_in_proj", "action_time_mlp_in", "action_time_mlp_out", "action_out_proj")
POLICY_TYPE = "smolvla"

KNOWN_VLMS = {
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": {
        "num_heads": 15, "num_kv_heads": 5, "head_dim": 64, "rms_norm_eps": 1e-5,
        "vision_heads": 12, "vision_layer_norm_eps": 1e-6},
}
"""What SmolVLM's own config fixes and the tensor shapes do not (head split, epsilons), per ``vlm_model_name``."""

_REFUSED = {
    "add_image_special_tokens": "tokens around each image (add_image_special_tokens: true)",
    "adapt_to_pi_aloha": "Aloha's joint remapping (adapt_to_pi_aloha: true)",
    "use_delta_joint_actions_aloha": "Aloha's delta joint actions (use_delta_joint_actions_aloha: true)",
}


def is_lerobot_smolvla(hf_dir: str) -> bool:
    """Whether ``hf_dir`` holds a LeRobot SmolVLA checkpoint (config.json ``"type": "smolvla"``)."""
    return lerobot_policy_type(hf_dir) == POLICY_TYPE


def _known(top: dict, key: str, path: str, what: str):
    name = str(top.get("vlm_model_name", ""))
    if name not in KNOWN_VLMS:
        raise ConfigError(f"{path}: {what} of the VLM {name!r} are not in the checkpoint's shapes and it is not a "
                          f"known one ({', '.join(KNOWN_VLMS)}); give them in the config's llm / vision section "
                          f"(with the checkpoint's hidden_dim)")
    return KNOWN_VLMS[name][key]


def _text_dims(base: ModelConfig, top: dict, width: int, q_out: int, kv_out: int, path: str) -> dict:
    llm = base.llm
    if llm.hidden_dim == width and llm.num_heads * llm.head_dim == q_out and llm.num_kv_heads * llm.head_dim == kv_out:
        return {"num_heads": llm.num_heads, "num_kv_heads": llm.num_kv_heads, "head_dim": llm.head_dim,
                "rms_norm_eps": llm.rms_norm_eps}
    dims = {k: _known(top, k, path, "the attention heads") for k in ("num_heads", "num_kv_heads", "head_dim",
                                                                    "rms_norm_eps")}
    if dims["num_heads"] * dims["head_dim"] != q_out or dims["num_kv_heads"] * dims["head_dim"] != kv_out:
        raise ConfigError(f"{path}: attention projections of {q_out} / {kv_out} outputs do not fit "
                          f"{top.get('vlm_model_name')!r}'s heads; set llm.num_heads / num_kv_heads / head_dim")
    return dims


def _vision_dims(base: ModelConfig, top: dict, width: int, path: str) -> tuple[int, float]:
    vis = base.vision
    if vis is not None and vis.hidden_dim == width and width % vis.num_heads == 0:
        return vis.num_heads, vis.layer_norm_eps
    return (_known(top, "vision_heads", path, "the vision heads"),
            _known(top, "vision_layer_norm_eps", path, "the vision heads"))


def _cross_layers(shapes: dict, depth: int, kv_width: int, top: dict, path: str) -> tuple[str, int]:
    """(action.expert_attention, self_attn_every_n_layers) of LeRobot's attention_mode, its pattern of cross- and
    self-attention layers checked against the k_proj input widths (self_attn: every layer attends jointly)."""
    mode = top.get("attention_mode", "cross_attn")
    if mode not in ("cross_attn", "self_attn"):
        raise ConfigError(f"{path}: attention_mode {mode!r} is not supported (cross_attn and self_attn are)")
    every = max(int(top.get("self_attn_every_n_layers", 2)), 0)  # LeRobot's -1: no joint layer, as 0 here
    pattern = [mode == "cross_attn" and not (every > 0 and i % every == 0) for i in range(depth)]
    for i, cross in enumerate(pattern):
        k_in = _need(shapes, f"{EXPERT}layers.{i}.self_attn.k_proj.weight", path)[1]
        e_width = _need(shapes, f"{EXPERT}layers.{i}.input_layernorm.weight", path)[0]
        if (k_in == kv_width) != cross and kv_width != e_width:
            raise ConfigError(f"{path}: expert layer {i} has k_proj of input width {k_in}, which does not fit "
                              f"attention_mode {mode} with self_attn_every_n_layers {every} "
                              f"({'cross' if cross else 'self'}-attention)")
    return ("cross_attn" if mode == "cross_attn" else "joint"), every


def prefill_buckets(fixed: int, max_text: int, smallest: int = 16, keep: float = 0.85) -> list[int]:
    """The prefill buckets of a prefix of ``fixed`` rows (the cameras' tokens, the state row) and a prompt of up
    to ``max_text`` tokens: one of the longest prompt, and one for prompts of the largest power of two of tokens
    (``smallest`` or more) whose bucket computes at most ``keep`` of its rows, where there is such a power.
    LeRobot pads SmolVLA's prompt to the longest in the batch, not to ``tokenizer_max_length`` (pi0's
    processors pad to it): with one bucket the usual instruction of a few words would compute up to a third
    more rows than LeRobot. The padded rows are masked out; each bucket is one more graph (a copy of the
    backbone's weights on openvino's CPU plugin), so there is one extra at most."""
    largest = fixed + max_text
    for k in range((max_text - 1).bit_length() - 1, max(smallest, 1).bit_length() - 2, -1):
        if (1 << k) >= smallest and fixed + (1 << k) <= keep * largest:
            return [fixed + (1 << k), largest]
    return [largest]


def config_from_lerobot_smolvla(hf_dir: str, base: ModelConfig) -> ModelConfig:
    """``base`` with everything the SmolVLA checkpoint in ``hf_dir`` fixes, an action-expert span of the prefix's
    size (cameras' tokens + ``tokenizer_max_length`` + the state row) and prefill buckets up to it; KV
    dtype, executor and the joint names (``action.state_joints``) stay from ``base``."""
    path, top = read_config(hf_dir)
    if top.get("type") != POLICY_TYPE:
        raise ConfigError(f"{path}: not a LeRobot SmolVLA config (type {top.get('type')!r})")
    for key, what in _REFUSED.items():
        if top.get(key):
            raise ConfigError(f"{path}: {what} is not supported")
    periods = (float(top.get("min_period", TIME_MIN_PERIOD)), float(top.get("max_period", TIME_MAX_PERIOD)))
    if periods != (TIME_MIN_PERIOD, TIME_MAX_PERIOD):
        raise ConfigError(f"{path}: min_period / max_period {periods} differ from the time embedding's "
                          f"({TIME_MIN_PERIOD}, {TIME_MAX_PERIOD})")
    _, shapes = _shapes(hf_dir)
    # a tied table is saved once, under the name that sorts first: the head's
    vocab, width = _need(shapes, TEXT + "embed_tokens.weight" if TEXT + "embed_tokens.weight" in shapes else LM_HEAD,
                         path)
    q_out = _need(shapes, TEXT + "layers.0.self_attn.q_proj.weight", path)[0]
    kv_out = _need(shapes, TEXT + "layers.0.self_attn.k_proj.weight", path)[0]
    text = _text_dims(base, top, width, q_out, kv_out, path)
    depth = _layers(shapes, TEXT)
    if int(top.get("num_vlm_layers", depth)) != depth:
        raise ConfigError(f"{path}: num_vlm_layers is {top.get('num_vlm_layers')}, the checkpoint holds {depth} "
                          f"language-model layers")
    expert_depth = _layers(shapes, EXPERT)
    if expert_depth != depth:
        raise ConfigError(f"{path}: the action expert has {expert_depth} layers, the language model {depth}; only "
                          f"an expert paired layer by layer (num_expert_layers <= 0 or equal) is supported")
    attention, every = _cross_layers(shapes, depth, kv_out, top, path)
    e_width = _need(shapes, "action_in_proj.weight", path)[0]
    patch = _need(shapes, VISION + "embeddings.patch_embedding.weight", path)
    v_width, _, p_h, p_w = patch
    positions = _need(shapes, VISION + "embeddings.position_embedding.weight", path)[0]
    side = math.isqrt(positions)
    proj_in = _need(shapes, CONNECTOR, path)[1]
    block = proj_in // v_width
    s = math.isqrt(block)
    if p_h != p_w or side * side != positions or s * s * v_width != proj_in or side % s:
        raise ConfigError(f"{path}: a {side}x{side} grid of {p_h}x{p_w} patches with a connector of {proj_in} inputs "
                          f"({v_width} wide patches) is not a square pixel shuffle")
    res = side * p_h
    pad = top.get("resize_imgs_with_padding") or [res, res]
    if list(pad) != [res, res]:
        raise ConfigError(f"{path}: resize_imgs_with_padding {list(pad)} differs from the vision tower's "
                          f"{res}x{res} input")
    v_heads, v_eps = _vision_dims(base, top, v_width, path)
    features = top.get("input_features") or {}
    cameras = [k[len("observation.images."):] for k, f in features.items()
               if k.startswith("observation.images.") and (f or {}).get("type") == "VISUAL"
               and not k.startswith("observation.images.empty_camera_")]  # empty cameras are masked out
    if not cameras:
        raise ConfigError(f"{path}: input_features names no camera (observation.images.<name>)")
    state_true = int((((features.get("observation.state") or {}).get("shape")) or [0])[0])
    action_true = int((((top.get("output_features") or {}).get("action") or {}).get("shape") or [0])[0])
    max_state = _need(shapes, "state_proj.weight", path)[1]
    max_action = _need(shapes, "action_in_proj.weight", path)[1]
    joints = state_joints(base, path, state_true, action_true, max_state, max_action)
    tokens = (side // s) ** 2
    max_instr = int(top.get("tokenizer_max_length", 48))
    prefix = tokens * len(cameras) + max_instr + 1  # cameras, the longest instruction, the state row
    span = -(-prefix // 8) * 8  # the cache rounded up to 8 positions: KV views 256-byte aligned (TensorRT)
    return base.with_overrides(
        mode="vla",
        vision={"architecture": "vit", "resolution": [res, res], "tile_size": [res, res], "tokens_per_tile": tokens,
                "patch_size": p_h, "hidden_dim": v_width, "num_layers": _layers(shapes, VISION + "encoder."),
                "num_heads": v_heads, "layer_norm_eps": v_eps,
                "intermediate_size": _need(shapes, VISION + "encoder.layers.0.mlp.fc1.weight", path)[0],
                "token_merge": "pixel_shuffle", "projector_bias": False, "output_scale": math.sqrt(width),
                "resize": "letterbox_bottom_right", "pad_value": 0,
                "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "cameras": cameras},
        llm={"num_layers": depth, "hidden_dim": width, "vocab_size": vocab, **text,
             "intermediate_size": _need(shapes, TEXT + "layers.0.mlp.gate_proj.weight", path)[0],
             "architecture": "llama", "rope_theta": 10000.0, "embed_scale": math.sqrt(width),
             "tie_word_embeddings": LM_HEAD not in shapes or TEXT + "embed_tokens.weight" not in shapes,
             "mrope_section": [], "prefill_attention": "bidirectional",
             "prefill_buckets": prefill_buckets(tokens * len(cameras) + 1, max_instr), "decode_buckets": [span],
             "max_seq_len": span},
        action={"head_type": "flow_matching", "action_dim": max_action, "output_dim": action_true,
                "action_horizon": int(top.get("chunk_size", 50)), "num_denoise_steps": int(top.get("num_steps", 10)),
                "expert_hidden_dim": e_width,
                "expert_intermediate_size": _need(shapes, EXPERT + "layers.0.mlp.gate_proj.weight", path)[0],
                "state_dim": max_state, "state_joints": joints, "time_conditioning": "action_mlp",
                "state_input": "prefix", "expert_attention": attention, "self_attn_every_n_layers": every,
                "action_attention": "causal", "norm_q01": [], "norm_q99": [], "norm_mask": [],
                "state_norm": _norm("STATE", "observation.state", hf_dir, "policy_preprocessor",
                                    "normalizer_processor", state_true),
                "action_norm": _norm("ACTION", "action", hf_dir, "policy_postprocessor", "unnormalizer_processor",
                                     action_true)},
        tokenizer={"max_instruction_tokens": max_instr, "prompt_template": "{instruction}\n", "instruction_bos": "",
                   "prompt_special_tokens": True},
    )


def load_lerobot_smolvla(hf_dir: str, lm, vision, expert, state_proj) -> None:
    """Copy the checkpoint's weights (float32) into the language model, the vision encoder, the action expert
    and the state projection of the prefill graphs, each matched strictly by name and shape."""
    files, _ = _shapes(hf_dir)
    targets = {"language model": (lm, {}), "vision encoder": (vision, {}), "action expert": (expert, {}),
               "state projection": (state_proj, {})}
    unexpected = []
    for key in files:
        name = _key(key)
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.startswith(TEXT):
            targets["language model"][1][key] = "model." + name[len(TEXT):]
        elif name == LM_HEAD:  # the head, or the tied table saved under its name
            tied = lm.llm.tie_word_embeddings
            if not tied or TEXT + "embed_tokens.weight" not in {_key(k) for k in files}:
                targets["language model"][1][key] = "model.embed_tokens.weight" if tied else "lm_head.weight"
        elif name.startswith(VISION):
            targets["vision encoder"][1][key] = _vision_names(name[len(VISION):])
        elif name == CONNECTOR:
            targets["vision encoder"][1][key] = "multi_modal_projector.weight"
        elif name.startswith(EXPERT):
            targets["action expert"][1][key] = name[len(EXPERT):]
        elif name.split(".")[0] in _PROJECTIONS:
            targets["action expert"][1][key] = name
        elif name.startswith("state_proj."):
            targets["state projection"][1][key] = name[len("state_proj."):]
        else:
            unexpected.append(key)
    if unexpected:
        raise ConfigError(f"{hf_dir}: tensors that are not part of SmolVLA: {sorted(unexpected)[:8]}")
    for what, (module, wanted) in targets.items():
        params = dict(module.named_parameters(remove_duplicate=False))
        expected = {n for n in params if not n.startswith(("rope_", "head_t")) and not n.endswith(_EXPORT_LAYOUT)
                    and not (n == "lm_head.weight" and lm.llm.tie_word_embeddings)}
        copy_checked(params, files, wanted, expected, [], hf_dir, f"SmolVLA's {what} of this config",
                     "build the config from the checkpoint (synflux-build --from-hf does)")
