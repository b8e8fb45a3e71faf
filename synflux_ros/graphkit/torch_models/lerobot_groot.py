"""GR00T N1.7 graph modules (``action.expert_type: dit``): random weights, or a GR00T N1.7 checkpoint saved by
LeRobot 0.6 (``"type": "groot"``) with the base model directory its ``base_model_path`` names.

A LeRobot GR00T checkpoint's ``config.json`` holds no model sizes: they are in the base model's ``config.json``
(NVIDIA's GR00T N1.7 format: ``select_layer``, ``diffusion_model_cfg``, ``vl_self_attention_cfg``, ...), and the
backbone's in the Qwen3-VL ``config.json`` of the directory its ``model_name`` names. The weights are all in the
fine-tuned checkpoint: ``_groot_model.backbone.model.model.{visual,language_model}.*`` and
``_groot_model.action_head.*``.
"""
from __future__ import annotations

import os

import torch

from ...core.config import ConfigError, ModelConfig
from .checkpoint import copy_checked, read_config, read_tensors, tensor_files
from .decoder import CausalLM, EmbedGraph, init_random, materialize
from .groot import CategoryLinear, DiTGraph, FeaturesGraph, GrootHead, VLContextGraph
from .groot_vjp import DiTVJPGraph
from .hf_decoder import hf_llm_fields
from .lerobot_pi0 import _processor_steps, lerobot_policy_type, state_joints
from .qwen3_vl_vision import build_qwen3_vl_vision, vision_config_from_hf

POLICY_TYPE = "groot"
ROOT = "_groot_model."
VISION = ROOT + "backbone.model.model.visual."
TEXT = ROOT + "backbone.model.model.language_model."
HEAD = ROOT + "action_head."
LM_HEAD = ROOT + "backbone.model.lm_head.weight"
PACK_STEP = "groot_n1_7_pack_inputs_v1"
VLM_STEP = "groot_n1_7_vlm_encode_v1"
N1_5_STEPS = ("groot_pack_inputs_v3", "groot_eagle_encode_v3", "groot_eagle_collate_v3",
              "groot_action_unpack_unnormalize_v1")
"""The processor steps of a GR00T N1.5 checkpoint (LeRobot 0.4 and 0.5)."""
DECODE_STEP = "groot_action_unpack_unnormalize_v2"
"""The postprocessor step of a LeRobot fine-tune on its dataset's statistics: clipped min-max of the env's actions."""
BASE_STATS_DECODE = "groot_n1_7_action_decode_v1"
"""The postprocessor step that decodes with the base model's per-modality statistics (a pretrained embodiment)."""


def is_lerobot_groot(hf_dir: str) -> bool:
    """Whether ``hf_dir`` holds a LeRobot GR00T checkpoint (config.json ``"type": "groot"``)."""
    return lerobot_policy_type(hf_dir) == POLICY_TYPE


def _local_dir(name: str, against: str, what: str, where: str) -> str:
    """``name`` as a local directory (relative to ``against`` when relative); ConfigError saying what is missing."""
    if not name:
        raise ConfigError(f"{where}: {what} is not set")
    path = name if os.path.isabs(name) else os.path.join(against, name)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.isdir(name):
        return os.path.abspath(name)
    raise ConfigError(f"{where}: {what} {name!r} is not a local directory: GR00T's sizes and tokenizer come from "
                      f"it; download it (for instance with huggingface-cli download {name} --local-dir DIR) and "
                      f"point {what} at DIR")


N1_5_REFUSAL = ("a GR00T N1.5 checkpoint (LeRobot 0.4 / 0.5): its Eagle 2.5 backbone (SigLIP 2 with pixel shuffle and an "
                "MLP connector, Qwen3-1.7B cut at 12 layers, no DeepStack or multimodal rope), its DiT without the "
                "text / image alternation, with 32 learned future tokens between the state and the actions, and its "
                "processor steps ({steps}) are not what the GR00T N1.7 graph set carries; only GR00T N1.7 "
                "(LeRobot 0.6, Qwen3-VL backbone) is imported")


def _refuse_n1_5(hf_dir: str, path: str, top: dict) -> None:
    """ConfigError naming what an N1.5 checkpoint has that the N1.7 graphs lack (LeRobot 0.6.1 refuses it too)."""
    steps = [s.get("registry_name") for p in ("policy_preprocessor", "policy_postprocessor")
             for s in _processor_steps(hf_dir, p) if s.get("registry_name") in N1_5_STEPS]
    if steps or top.get("tokenizer_assets_repo"):
        raise ConfigError(f"{path}: " + N1_5_REFUSAL.format(steps=", ".join(steps) or "groot_*_v3"))


def groot_dirs(hf_dir: str) -> tuple[dict, str, dict, str]:
    """(the policy config, the base model directory, its GR00T config, the Qwen3-VL backbone directory)."""
    path, top = read_config(hf_dir)
    _refuse_n1_5(hf_dir, path, top)
    base_dir = _local_dir(str(top.get("base_model_path") or ""), hf_dir, "base_model_path", path)
    base_path, base = read_config(base_dir)
    if "backbone_cfg" in base or str(base.get("model_type", "")).lower().startswith("gr00t_n1_5"):
        raise ConfigError(f"{base_path}: the base model is " + N1_5_REFUSAL.format(steps="groot_*_v3"))
    if base.get("use_alternate_vl_dit", True) is not True:
        raise ConfigError(f"{base_path}: use_alternate_vl_dit false: only GR00T N1.7's DiT (cross-attention to the "
                          f"text and image rows in turn) is supported")
    backbone_dir = _local_dir(str(base.get("model_name") or ""), base_dir, "model_name", base_path)
    return top, base_dir, base, backbone_dir


def _pack_step(hf_dir: str) -> dict:
    step = next((s for s in _processor_steps(hf_dir, "policy_preprocessor") if s.get("registry_name") == PACK_STEP),
                None)
    if step is None:
        raise ConfigError(f"{hf_dir}/policy_preprocessor.json: no {PACK_STEP} step (not a GR00T N1.7 processor, or "
                          f"none saved)")
    return step


def _stats(hf_dir: str, step: dict) -> dict:
    state = step.get("state_file")
    if not state:
        return {}
    path = os.path.join(hf_dir, state)
    if not os.path.isfile(path):
        raise ConfigError(f"{hf_dir}: the {step.get('registry_name')} step names {state}, which is missing")
    from safetensors import safe_open
    with safe_open(path, framework="pt") as fh:
        keys = list(fh.keys())
    return {k: t.reshape(-1).tolist() for k, t in read_tensors({k: path for k in keys})}


def _bounds(stats: dict, feature: str, dim: int, where: str) -> dict | None:
    low, high = stats.get(f"{feature}.min"), stats.get(f"{feature}.max")
    if low is None and high is None:
        return None
    if low is None or high is None or len(low) != dim or len(high) != dim:
        raise ConfigError(f"{where}: {feature} needs min and max of {dim} values each")
    return {"mode": "bounds", "low": low, "high": high, "clip": True}


def _geometry(hf_dir: str) -> dict:
    """The vision fields of GR00T's image path (its VLM step): each camera stretched to a square, a centred crop,
    resized to image_target_size, all bicubic on uint8 (``vision.interpolation: bicubic``, ``crop_fraction``)."""
    where = f"{hf_dir}/policy_preprocessor.json"
    step = next((s for s in _processor_steps(hf_dir, "policy_preprocessor") if s.get("registry_name") == VLM_STEP),
                None)
    if step is None:
        raise ConfigError(f"{where}: no {VLM_STEP} step")
    c = step.get("config") or {}
    for flag, what in (("use_albumentations", "the albumentations image path (aspect-preserving resizes)"),
                       ("letter_box_transform", "the letterbox before the square resize")):
        if c.get(flag):
            raise ConfigError(f"{where}: {VLM_STEP}.{flag}: {what} is not supported")
    target = [int(v) for v in (c.get("image_target_size") or (256, 256))]
    crop = c.get("crop_fraction")
    if crop is None and c.get("image_crop_size"):
        crop = float(c["image_crop_size"][0]) / target[0]
    crop = float(crop) if crop is not None and 0.0 < float(crop) < 1.0 else 1.0
    return {"resolution": target, "tile_size": target, "resize": "stretch", "interpolation": "bicubic",
            "crop_fraction": crop, "crop_edge": int(c.get("shortest_image_edge") or 0)}


def _decode_step(hf_dir: str) -> dict:
    """The postprocessor's action step; ConfigError for the decodings the graphs' runtime does not do."""
    where = f"{hf_dir}/policy_postprocessor.json"
    steps = {s.get("registry_name"): s for s in _processor_steps(hf_dir, "policy_postprocessor")}
    if BASE_STATS_DECODE in steps:
        raise ConfigError(f"{where}: {BASE_STATS_DECODE} decodes the actions with the base model's statistics per "
                          f"modality group (its raw_stats: per-step relative groups, end-effector rotations), which "
                          f"the import does not map; a fine-tune on its dataset's statistics ({DECODE_STEP}) imports")
    step = steps.get(DECODE_STEP)
    if step is None:
        raise ConfigError(f"{where}: no {DECODE_STEP} step (how the actions are un-normalised)")
    c = step.get("config") or {}
    if c.get("libero_gripper_action"):
        raise ConfigError(f"{where}: {DECODE_STEP}.libero_gripper_action: LIBERO's gripper transform is not supported")
    return step


def config_from_lerobot_groot(hf_dir: str, base: ModelConfig) -> ModelConfig:
    """``base`` with everything a LeRobot GR00T N1.7 checkpoint fixes: the backbone's sizes (cut at select_layer),
    the vision tower's, the action head's, the embodiment, the cameras' count, state/action sizes and min-max
    statistics. ``base`` keeps the buckets, resolution, state_joints and what else is the robot's."""
    top, base_dir, g, backbone_dir = groot_dirs(hf_dir)
    where = os.path.join(base_dir, "config.json")
    pack = _pack_step(hf_dir)
    pc = pack.get("config") or {}
    if int(g.get("state_history_length", 1)) != 1 or int(pc.get("state_horizon", 1)) != 1:
        raise ConfigError(f"{where}: state_history_length > 1 is not supported (one state per frame)")
    if g.get("apply_sincos_state_encoding"):
        raise ConfigError(f"{where}: apply_sincos_state_encoding is not supported")
    if top.get("use_relative_actions") or g.get("use_relative_action"):
        raise ConfigError(f"{hf_dir}: relative actions are not supported for GR00T yet")
    _, llm, _ = hf_llm_fields(backbone_dir)
    select = int(g.get("select_layer", llm["num_layers"]))
    if not 0 < select <= llm["num_layers"]:
        raise ConfigError(f"{where}: select_layer {select} outside 1..{llm['num_layers']}")
    llm["num_layers"] = select
    llm["prefill_attention"] = "causal"
    if int(g.get("backbone_embedding_dim", llm["hidden_dim"])) != llm["hidden_dim"]:
        raise ConfigError(f"{where}: backbone_embedding_dim {g['backbone_embedding_dim']} differs from the backbone's "
                          f"width {llm['hidden_dim']} (reproject_vision is not supported)")
    dit, vl = g.get("diffusion_model_cfg") or {}, g.get("vl_self_attention_cfg") or {}
    if not g.get("use_vlln", True) or not g.get("add_pos_embed", True):
        raise ConfigError(f"{where}: use_vlln and add_pos_embed must be true (GR00T N1.7)")
    if int(dit.get("output_dim", g.get("hidden_size", 1024))) != int(g.get("hidden_size", 1024)):
        raise ConfigError(f"{where}: diffusion_model_cfg.output_dim must equal hidden_size")
    mapping = pc.get("embodiment_mapping") or {}
    tag = str(pc.get("embodiment_tag") or top.get("embodiment_tag") or "new_embodiment")
    emb_file = os.path.join(base_dir, "embodiment_id.json")
    if os.path.isfile(emb_file):
        from .checkpoint import read_json
        mapping = {**mapping, **read_json(emb_file)}
    embodiment = int(mapping.get(tag, 0))
    max_state, max_action = int(pc.get("max_state_dim", g.get("max_state_dim", 132))), \
        int(pc.get("max_action_dim", g.get("max_action_dim", 132)))
    stats = _stats(hf_dir, pack)
    feats = top.get("input_features") or {}
    state_true = int((feats.get("observation.state") or {}).get("shape", [0])[0])
    action_true = int(((top.get("output_features") or {}).get("action") or {}).get("shape", [0])[0])
    joints = state_joints(base, os.path.join(hf_dir, "config.json"), state_true, action_true, max_state, max_action)
    cameras = sorted(k[len("observation.images."):] for k in feats if k.startswith("observation.images."))
    keys = pc.get("video_modality_keys")
    if keys:  # the checkpoint's camera order
        cameras = [k for k in keys if k in cameras] + [k for k in cameras if k not in keys]
    if not cameras:
        raise ConfigError(f"{hf_dir}/config.json: no observation.images.* input features")
    decode = _decode_step(hf_dir)
    dc = decode.get("config") or {}
    norms = {}
    if pc.get("normalize_min_max", True):
        norms["state_norm"] = _bounds(stats, "observation.state", state_true, hf_dir)
        if norms["state_norm"] is None:
            raise ConfigError(f"{hf_dir}: the {PACK_STEP} step normalises the state but its state file has no "
                              f"observation.state.min / max")
        norms["state_norm"]["clip"] = bool(pc.get("clip_outliers", True))
    if dc.get("normalize_min_max", True):
        norms["action_norm"] = _bounds(_stats(hf_dir, decode), "action", action_true, hf_dir)
        if norms["action_norm"] is None:
            raise ConfigError(f"{hf_dir}: the {DECODE_STEP} step un-normalises the actions but its state file has no "
                              f"action.min / max")
        norms["action_norm"]["clip"] = bool(dc.get("clip_normalized_action", True))
    horizon = int(g.get("action_horizon", 40))  # the model's (its position table, its DiT's tokens)
    # LeRobot publishes the first min(horizon, chunk_size, n_action_steps) steps of the model's horizon
    cut = min([horizon] + [int(v) for v in (top.get("chunk_size"), top.get("n_action_steps"),
                                           pc.get("valid_action_horizon")) if int(v or 0) > 0])
    action = dict(
        head_type="flow_matching", expert_type="dit", action_dim=max_action, action_horizon=horizon,
        output_horizon=cut if cut < horizon else 0,
        num_denoise_steps=int(top.get("num_inference_timesteps") or g.get("num_inference_timesteps", 4)),
        dit_layers=int(dit.get("num_layers", 32)), dit_heads=int(dit.get("num_attention_heads", 32)),
        dit_head_dim=int(dit.get("attention_head_dim", 48)), dit_hidden_dim=int(g.get("hidden_size", 1024)),
        dit_text_every_n_blocks=int(g.get("attend_text_every_n_blocks", 2)),
        vl_layers=int(vl.get("num_layers", 0)), vl_heads=int(vl.get("num_attention_heads", 0)) if vl.get("num_layers") else 0,
        vl_head_dim=int(vl.get("attention_head_dim", 0)) if vl.get("num_layers") else 0,
        time_buckets=int(g.get("num_timestep_buckets", 1000)), embodiment=embodiment,
        num_embodiments=int(g.get("max_num_embodiments", 32)), state_dim=max_state, state_joints=joints,
        state_input="token", output_dim=action_true, formalize_language=bool(pc.get("formalize_language", True)),
        rtc_ramp_rate=float(top.get("rtc_ramp_rate") or g.get("rtc_ramp_rate", 6.0)),
        **{k: v for k, v in norms.items() if v})
    if int(dit.get("num_attention_heads", 32)) * int(dit.get("attention_head_dim", 48)) != \
            int(g.get("input_embedding_dim", 1536)):
        raise ConfigError(f"{where}: input_embedding_dim must equal the DiT's heads x head width")
    vision = {"cameras": cameras, **_geometry(hf_dir)}
    cfg = base.with_overrides(llm=llm, action=action, vision=vision)
    return vision_config_from_hf(backbone_dir, cfg)


def _load_head(head: GrootHead, hf_dir: str, embodiment: int) -> None:
    """The action head's tensors into ``head``: per-embodiment linears sliced at ``embodiment``, the position
    table cut to the horizon."""
    params = dict(head.named_parameters())
    files = tensor_files(hf_dir, keep=lambda k: k.startswith(HEAD))
    category = {n for n, m in head.named_modules() if isinstance(m, CategoryLinear)}
    wanted, unexpected = {}, []
    for key in files:
        name = key[len(HEAD):]
        if name in params:
            wanted[key] = name
        else:
            unexpected.append(key)
    missing = sorted(set(params) - set(wanted.values()))
    if missing or unexpected:
        raise ConfigError(f"{hf_dir}: the action head does not match GR00T N1.7 of this config: "
                          f"{'missing ' + str(missing[:8]) if missing else ''} "
                          f"{'unexpected ' + str(sorted(unexpected)[:8]) if unexpected else ''}".strip())
    with torch.no_grad():
        for key, tensor in read_tensors({k: files[k] for k in wanted}):
            name = wanted[key]
            target = params[name]
            if name.rsplit(".", 1)[0] in category:
                if tensor.shape[0] <= embodiment:
                    raise ConfigError(f"{hf_dir}: {key} has {tensor.shape[0]} embodiments, action.embodiment is "
                                      f"{embodiment}")
                tensor = tensor[embodiment]
            elif name == "position_embedding.weight":
                if tensor.shape[0] < target.shape[0]:
                    raise ConfigError(f"{hf_dir}: {key} has {tensor.shape[0]} positions for a horizon of "
                                      f"{target.shape[0]}")
                tensor = tensor[:target.shape[0]]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ConfigError(f"{hf_dir}: {key} has shape {list(tensor.shape)}, the graphs expect "
                                  f"{list(target.shape)} (build the config from the checkpoint)")
            target.copy_(tensor)


def _load_text(lm: CausalLM, hf_dir: str) -> None:
    """The cut language model's tensors (``language_model.*``) into ``lm``; its final norm and head are not read
    by any GR00T graph and stay at identity / the embedding when the checkpoint lacks them."""
    params = dict(lm.named_parameters(remove_duplicate=False))
    files = tensor_files(hf_dir, keep=lambda k: k.startswith(TEXT) or k == LM_HEAD)
    wanted, unexpected = {}, []
    for key in files:
        name = "model." + key[len(TEXT):] if key != LM_HEAD else "lm_head.weight"
        (wanted.__setitem__(key, name) if name in params else unexpected.append(key))
    if "model.embed_tokens.weight" not in wanted.values() and LM_HEAD in files and lm.llm.tie_word_embeddings:
        # the tied table saved once, under the name that sorts first (the head's)
        wanted[LM_HEAD] = "model.embed_tokens.weight"
    unused = {"lm_head.weight", "model.norm.weight"}
    expected = set(params) - unused
    copy_checked(params, files, wanted, expected, unexpected, hf_dir, "the cut Qwen3-VL language model of this config",
                 "build the config from the checkpoint")
    with torch.no_grad():
        if "model.norm.weight" not in wanted.values():
            lm.model.norm.weight.fill_(1.0)
        if not lm.llm.tie_word_embeddings and "lm_head.weight" not in wanted.values():
            lm.lm_head.weight.copy_(lm.model.embed_tokens.weight)

_STREAMS = {"decoder": 0, "head": 4}


def _random(factory, seed: int, stream: str):
    with torch.device("meta"):
        module = factory()
    materialize(module)
    init_random(module, torch.Generator().manual_seed(int(seed) * 1_000_003 + _STREAMS[stream]))
    return module.eval()


def groot_graph_modules(cfg: ModelConfig, seed: int = 0, hf_dir: str | None = None):
    """(modules by graph name, the checkpoint's tokenizer.json or None, source) for ``graph_set(cfg)`` of a GR00T
    config."""
    from ...core.contract import graph_set
    tokenizer = None
    if hf_dir:
        _, _, _, backbone_dir = groot_dirs(hf_dir)
        with torch.device("meta"):
            lm, head = CausalLM(cfg.llm), GrootHead(cfg)
        for module in (lm, head):
            materialize(module)
            module.eval()
        _load_text(lm, hf_dir)
        _load_head(head, hf_dir, cfg.action.embodiment)
        files = tensor_files(hf_dir, keep=lambda k: k.startswith(VISION))
        weights = {k[len(VISION):]: t for k, t in read_tensors(files)}
        vision = build_qwen3_vl_vision(cfg, seed=seed, hf_dir=backbone_dir, state_dict=weights)
        tok = os.path.join(backbone_dir, "tokenizer.json")
        tokenizer = tok if os.path.isfile(tok) else None
        source = {"weights": "hf", "path": os.path.abspath(hf_dir), "model_type": "lerobot_groot", "random": [],
                  "seed": seed}
    else:
        lm = _random(lambda: CausalLM(cfg.llm), seed, "decoder")
        head = _random(lambda: GrootHead(cfg), seed, "head")
        vision = build_qwen3_vl_vision(cfg, seed=seed)
        source = {"weights": "random", "seed": seed}
    lm.finalize_weights(join=False)
    modules = {}
    deepstack = bool(cfg.vision.num_deepstack)
    for meta in graph_set(cfg):
        p = meta.attrs.get("bucket")
        modules[meta.name] = {
            "vision_encoder": lambda: vision,
            "embed": lambda: EmbedGraph(lm, p).eval(),
            "features": lambda: FeaturesGraph(lm, p, deepstack).eval(),
            "vl_context": lambda: VLContextGraph(head, p).eval(),
            "dit": lambda: DiTGraph(head, p).eval(),
            "dit_vjp": lambda: DiTVJPGraph(head, p).eval(),
        }[meta.kind]()
    return modules, tokenizer, source
