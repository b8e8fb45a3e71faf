"""LeRobot pi0 and pi0.5 checkpoints (``synflux-build --from-hf DIR`` on a directory whose config.json says
``"type": "pi0"`` or ``"pi05"``): the model's dimensions, cameras, state/action sizes and normalisation into a
:class:`ModelConfig`, and its weights into the graph modules.

pi0.5 differs in the action expert (adaptive RMSNorm conditioned on the flow time by ``time_mlp_in`` /
``time_mlp_out``; no action-time MLP, no state token) and in its prompt, which holds the discretised state
(``action.time_conditioning: adarms``, ``action.state_input: prompt``).

SigLIP and its projector become ``vision_encoder``, PaliGemma's Gemma the bidirectional prefill, the Gemma
action expert with pi0's action projections ``action_expert_<d>``, the normalizer statistics
``action.state_norm`` / ``action.action_norm``. The PaliGemma tokenizer is not part of the checkpoint: give
``tokenizer.path`` or put tokenizer.json beside it. The checkpoint layout, the full mapping and what is not
imported are described in docs/internals/build.md.
"""
from __future__ import annotations

import os
import re

from ...core.config import ConfigError, ModelConfig
from ...model.heads.fast import fast_settings
from ...model.normalization import PI0_FAST_PROMPT, PI05_PROMPT
from .checkpoint import copy_checked, read_config, read_json, read_tensors, tensor_files, tensor_shapes

ROOT = "paligemma_with_expert."
VLM = ROOT + "paligemma.model.language_model."
VISION = ROOT + "paligemma.model.vision_tower.vision_model."
PROJECTOR = ROOT + "paligemma.model.multi_modal_projector.linear."
LM_HEAD = ROOT + "paligemma.lm_head.weight"
EXPERT = ROOT + "gemma_expert."
HEADS = {"gemma_2b": (8, 1, 256), "gemma_300m": (8, 1, 256)}  # LeRobot's variants: heads, kv heads, head_dim
SIGLIP_HEADS = 16  # So400m/14; its head count is not in the tensor shapes either
_PROJECTIONS = ("state_proj", "action_in_proj", "action_time_mlp_in", "action_time_mlp_out", "action_out_proj")
_MODES = {"MEAN_STD": ("mean_std", "mean", "std"), "MIN_MAX": ("bounds", "min", "max"),
          "QUANTILES": ("bounds", "q01", "q99"), "QUANTILE10": ("bounds", "q10", "q90")}


_EXPORT_LAYOUT = ("qkv_t", "q_t", "k_t", "v_t", "o_t", "gate_up_t", "gate_t", "up_t", "down_t")
"""Suffixes of the export-layout tensors (``decoder.fuse_projections``), derived after loading, not loaded."""


POLICY_TYPES = ("pi0", "pi05", "pi0_fast")
FAST_DIR = "fast"
"""pi0-FAST: the FAST action tokenizer (physical-intelligence/fast: tokenizer.json, processor_config.json), which
the checkpoint does not hold, in this directory beside it."""


def lerobot_policy_type(hf_dir: str) -> str | None:
    """The ``"type"`` config.json names in ``hf_dir`` (a LeRobot policy's), None without a readable one."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        return read_json(path).get("type")
    except ConfigError:
        return None


def is_lerobot_pi0(hf_dir: str) -> bool:
    """Whether ``hf_dir`` holds a LeRobot pi0 or pi0.5 checkpoint (config.json ``"type"`` in
    :data:`POLICY_TYPES`)."""
    return lerobot_policy_type(hf_dir) in POLICY_TYPES


RELATIVE_STEPS = ("relative_actions_processor", "absolute_actions_processor")
"""LeRobot 0.5+'s steps that make actions relative to the state (before the normaliser) and absolute again (after
the unnormaliser); saved, disabled, by every pi0 / pi0.5 / pi0-FAST checkpoint of those versions."""


def _processor_steps(hf_dir: str, pipeline: str) -> list[dict]:
    """The steps of a saved processor pipeline (``policy_preprocessor`` / ``policy_postprocessor``), [] without it."""
    path = os.path.join(hf_dir, f"{pipeline}.json")
    if not os.path.isfile(path):
        return []
    return [s for s in read_json(path).get("steps", []) if isinstance(s, dict)]


def saved_by_lerobot_05(hf_dir: str, top: dict) -> bool:
    """Whether LeRobot 0.5 or later saved the checkpoint: no file names a version, but those releases write
    ``pretrained_revision`` (every policy) and ``use_relative_actions`` (the pi family) into config.json and the
    relative-actions steps into the processor files, which LeRobot 0.4's loader refuses."""
    if "pretrained_revision" in top or "use_relative_actions" in top:
        return True
    return any(s.get("registry_name") in RELATIVE_STEPS
               for p in ("policy_preprocessor", "policy_postprocessor") for s in _processor_steps(hf_dir, p))


def relative_mask(hf_dir: str, path: str, top: dict, action_dim: int, state_dim: int) -> list[bool]:
    """``action.relative_mask`` of a checkpoint trained on actions relative to the state (LeRobot's
    ``use_relative_actions``), [] for absolute actions. As LeRobot runs it: the postprocessor's enabled
    ``absolute_actions_processor`` adds the raw state to the un-normalised actions where the preprocessor's
    ``relative_actions_processor`` masks them in: every dimension, but those whose ``action_names`` entry contains
    an ``exclude_joints`` token (case-insensitive)."""
    steps = {s.get("registry_name"): s.get("config") or {}
             for p in ("policy_preprocessor", "policy_postprocessor") for s in _processor_steps(hf_dir, p)}
    absolute = bool(steps.get("absolute_actions_processor", {}).get("enabled"))
    if bool(top.get("use_relative_actions")) != absolute:
        raise ConfigError(f"{path}: use_relative_actions is {bool(top.get('use_relative_actions'))}, but the saved "
                          f"postprocessor's absolute_actions_processor is {'en' if absolute else 'dis'}abled")
    if not absolute:
        return []
    relative = steps.get("relative_actions_processor")
    if relative is None:
        raise ConfigError(f"{path}: use_relative_actions: the saved preprocessor has no relative_actions_processor, "
                          f"whose mask says which actions are relative")
    if state_dim < action_dim:
        raise ConfigError(f"{path}: use_relative_actions adds state value i to action i, but the state has "
                          f"{state_dim} values for {action_dim} actions")
    tokens = [str(t).lower() for t in relative.get("exclude_joints") or [] if t]
    names = relative.get("action_names")
    if not tokens or names is None:
        return [True] * action_dim
    mask = [not any(t in str(n).lower() for t in tokens) for n in list(names)[:action_dim]]
    return mask + [True] * (action_dim - len(mask))


def _key(name: str) -> str:
    """A state-dict name without LeRobot's ``model.`` prefix (checkpoints are saved with it; LeRobot's
    loader adds it where it is missing, so both forms load)."""
    return name[len("model."):] if name.startswith("model.") else name


def _shapes(hf_dir: str) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """({checkpoint key: file}, {name without ``model.``: shape})."""
    files = tensor_files(hf_dir)
    return files, {_key(k): s for k, s in tensor_shapes(files).items()}


def _layers(shapes: dict, prefix: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", k))}
    if not found or found != set(range(max(found) + 1)):
        raise ConfigError(f"no consecutive '{prefix}layers.N' tensors (found layers {sorted(found)})")
    return len(found)


def _need(shapes: dict, name: str, where: str) -> tuple[int, ...]:
    if name not in shapes:
        raise ConfigError(f"{where}: tensor {name!r} is missing (not a LeRobot pi0 checkpoint?)")
    return shapes[name]


def _head_split(base: ModelConfig, q_out: int, kv_out: int, variant: str, where: str) -> tuple[int, int, int]:
    llm = base.llm
    if llm.num_heads * llm.head_dim == q_out and llm.num_kv_heads * llm.head_dim == kv_out:
        return llm.num_heads, llm.num_kv_heads, llm.head_dim
    if variant in HEADS:
        h, kv, dh = HEADS[variant]
        if h * dh == q_out and kv * dh == kv_out:
            return h, kv, dh
    raise ConfigError(f"{where}: attention projections of {q_out} (queries) and {kv_out} (keys) outputs fit neither "
                      f"the config's llm heads ({llm.num_heads} x {llm.head_dim}, {llm.num_kv_heads} KV) nor the "
                      f"variant {variant!r}; set llm.num_heads / num_kv_heads / head_dim to the checkpoint's")


def _processor_stats(hf_dir: str, pipeline: str, step_name: str) -> tuple[dict, dict, float, dict]:
    """(norm_map, features, eps, stats {key: tensor}) of a normalizer step of a saved processor pipeline;
    empty stats when the pipeline or its state file is absent (LeRobot then leaves values unchanged)."""
    path = os.path.join(hf_dir, f"{pipeline}.json")
    if not os.path.isfile(path):
        return {}, {}, 1e-8, {}
    steps = read_json(path).get("steps", [])
    step = next((s for s in steps if isinstance(s, dict) and s.get("registry_name") == step_name), None)
    if step is None:
        return {}, {}, 1e-8, {}
    config = step.get("config") or {}
    stats = {}
    if step.get("state_file"):
        state = os.path.join(hf_dir, step["state_file"])
        if not os.path.isfile(state):
            raise ConfigError(f"{path}: {step_name} names {step['state_file']}, which is not in {hf_dir}")
        from safetensors import safe_open
        with safe_open(state, framework="pt") as fh:
            keys = list(fh.keys())
        stats = dict(read_tensors({k: state for k in keys}))
    return config.get("norm_map") or {}, config.get("features") or {}, float(config.get("eps", 1e-8)), stats


def _norm(kind: str, feature: str, hf_dir: str, pipeline: str, step: str, dim: int) -> dict | None:
    """``action.state_norm`` / ``action_norm`` for ``feature`` from a saved normalizer step (None: identity)."""
    norm_map, _, eps, stats = _processor_stats(hf_dir, pipeline, step)
    mode = str(norm_map.get(kind, "IDENTITY")).upper()
    if mode == "IDENTITY" or not any(k.startswith(feature + ".") for k in stats):
        return None
    if mode not in _MODES:
        raise ConfigError(f"{hf_dir}/{pipeline}.json: normalisation mode {mode!r} for {kind} is not supported "
                          f"(supported: IDENTITY, {', '.join(_MODES)})")
    ours, a, b = _MODES[mode]
    missing = [s for s in (a, b) if f"{feature}.{s}" not in stats]
    if missing:
        raise ConfigError(f"{hf_dir}/{pipeline}.json: {mode} for {feature} needs the statistics {missing}")
    va, vb = (stats[f"{feature}.{s}"].reshape(-1).tolist() for s in (a, b))
    if len(va) != dim or len(vb) != dim:
        raise ConfigError(f"{hf_dir}: {feature} statistics have {len(va)} values, the feature has {dim}")
    fields = ("mean", "std") if ours == "mean_std" else ("low", "high")
    return {"mode": ours, fields[0]: va, fields[1]: vb, "eps": eps}


def config_from_lerobot_pi0(hf_dir: str, base: ModelConfig) -> ModelConfig:
    """``base`` with everything the pi0 checkpoint in ``hf_dir`` fixes (docs/internals/build.md) and buckets of the
    prefix's size (cameras' tokens + ``tokenizer_max_length``: one prefill bucket, one action-expert span, the
    KV cache); KV dtype, executor and the joint names (``action.state_joints``, which the checkpoint does not
    name) stay from ``base``."""
    path, top = read_config(hf_dir)
    if top.get("type") not in POLICY_TYPES:
        raise ConfigError(f"{path}: not a LeRobot pi0, pi0.5 or pi0-FAST config (type {top.get('type')!r})")
    pi05, fast = top["type"] == "pi05", top["type"] == "pi0_fast"
    files, shapes = _shapes(hf_dir)
    emb = _need(shapes, LM_HEAD, hf_dir) if LM_HEAD in shapes else _need(shapes, VLM + "embed_tokens.weight", hf_dir)
    vocab, width = emb
    q_out = _need(shapes, VLM + "layers.0.self_attn.q_proj.weight", hf_dir)[0]
    kv_out = _need(shapes, VLM + "layers.0.self_attn.k_proj.weight", hf_dir)[0]
    heads, kv_heads, head_dim = _head_split(base, q_out, kv_out, str(top.get("paligemma_variant", "")), hf_dir)
    depth = _layers(shapes, VLM)
    if not fast:
        _check_expert(shapes, depth, heads * head_dim, kv_heads * head_dim, hf_dir)
    patch = _need(shapes, VISION + "embeddings.patch_embedding.weight", hf_dir)
    v_width, _, p_h, p_w = patch
    positions = _need(shapes, VISION + "embeddings.position_embedding.weight", hf_dir)[0]
    res = top.get("image_resolution") or [224, 224]
    if len(res) != 2 or res[0] != res[1] or p_h != p_w or (res[0] // p_h) ** 2 != positions:
        raise ConfigError(f"{path}: image_resolution {res} with {p_h}x{p_w} patches does not give the "
                          f"{positions} vision positions of the checkpoint")
    features = top.get("input_features") or {}
    cameras = [k[len("observation.images."):] for k, f in features.items()
               if k.startswith("observation.images.") and (f or {}).get("type") == "VISUAL"]
    if not cameras:
        raise ConfigError(f"{path}: input_features names no camera (observation.images.<name>)")
    state_feature = features.get("observation.state") or {}
    state_true = int((state_feature.get("shape") or [0])[0])
    action_true = int((((top.get("output_features") or {}).get("action") or {}).get("shape") or [0])[0])
    # pi0.5's and pi0-FAST's state goes into the prompt, padded to max_state_dim; pi0's state token is state_proj's
    # input. pi0-FAST decodes the true action dimensions.
    max_state = int(top.get("max_state_dim", 32)) if pi05 or fast else _need(shapes, "state_proj.weight", hf_dir)[1]
    max_action = action_true if fast else _need(shapes, "action_in_proj.weight", hf_dir)[1]
    if pi05:
        _need(shapes, EXPERT + "model.layers.0.input_layernorm.dense.weight", hf_dir)  # adaptive norms
    joints = state_joints(base, path, state_true, action_true, max_state, max_action)
    tokens = (res[0] // p_h) ** 2
    max_instr = int(top.get("tokenizer_max_length", 200 if pi05 or fast else 48))
    # The prefix (cameras and the longest instruction) is the whole context: one prefill bucket, and the action
    # expert's attention span, of its size.
    prefix = tokens * len(cameras) + max_instr
    vision = {"architecture": "vit", "resolution": [res[0], res[1]], "tile_size": [res[0], res[1]],
              "tokens_per_tile": tokens, "patch_size": p_h, "hidden_dim": v_width,
              "num_layers": _layers(shapes, VISION + "encoder."),
              "num_heads": base.vision.num_heads if base.vision and v_width % base.vision.num_heads == 0
              and base.vision.hidden_dim == v_width else SIGLIP_HEADS,
              "intermediate_size": _need(shapes, VISION + "encoder.layers.0.mlp.fc1.weight", hf_dir)[0],
              "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "cameras": cameras}
    llm = {"num_layers": depth, "hidden_dim": width, "num_heads": heads, "num_kv_heads": kv_heads,
           "head_dim": head_dim, "vocab_size": vocab,
           "intermediate_size": _need(shapes, VLM + "layers.0.mlp.gate_proj.weight", hf_dir)[0],
           "architecture": "gemma", "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": not (fast and _untied_head(files)),
           "mrope_section": [], "prefill_attention": "bidirectional"}
    norms = {"state_norm": _norm("STATE", "observation.state", hf_dir, "policy_preprocessor", "normalizer_processor",
                                 state_true),
             "action_norm": _norm("ACTION", "action", hf_dir, "policy_postprocessor", "unnormalizer_processor",
                                  action_true),
             "relative_mask": relative_mask(hf_dir, path, top, action_true, state_true)}
    # LeRobot 0.5+ writes the true state into pi0.5's and pi0-FAST's prompts; 0.4 the zero-padded one
    prompt_state = "joints" if (pi05 or fast) and saved_by_lerobot_05(hf_dir, top) else "padded"
    if fast:
        return _pi0_fast_config(hf_dir, path, top, base, vision, llm, norms, prefix + 1, max_instr, joints, max_state,
                                action_true, prompt_state)
    cfg = base.with_overrides(
        mode="vla",
        vision=vision,
        llm={**llm, "prefill_buckets": [prefix], "decode_buckets": [prefix], "max_seq_len": prefix},
        action={"head_type": "flow_matching", "action_dim": max_action, "output_dim": action_true,
                "action_horizon": int(top.get("chunk_size", 50)),
                "num_denoise_steps": int(top.get("num_inference_steps", 10)),
                "expert_hidden_dim": _need(shapes, "action_in_proj.weight", hf_dir)[0],
                "expert_intermediate_size": _need(shapes, EXPERT + "model.layers.0.mlp.gate_proj.weight", hf_dir)[0],
                "state_dim": max_state, "state_joints": joints,
                "time_conditioning": "adarms" if pi05 else "action_mlp", "state_input": "prompt" if pi05 else "token",
                "prompt_state": prompt_state,
                "norm_q01": [], "norm_q99": [], "norm_mask": [], **norms},
        tokenizer={"max_instruction_tokens": max_instr, "prompt_template": PI05_PROMPT if pi05 else "{instruction}\n",
                   "instruction_bos": "<bos>"},
    )
    return cfg


def state_joints(base: ModelConfig, path: str, state_true: int, action_true: int, max_state: int,
                 max_action: int) -> list[str]:
    """The base config's ``action.state_joints``, checked against the checkpoint's true state size (which names
    no joints), after the true sizes are checked against the padded ones."""
    if not 0 < action_true <= max_action or not 0 < state_true <= max_state:
        raise ConfigError(f"{path}: state ({state_true}) and action ({action_true}) dimensions must lie in "
                          f"1..{max_state} and 1..{max_action}")
    joints = list(base.action.state_joints) if base.action is not None else []
    if len(joints) != state_true:
        raise ConfigError(f"{path}: the checkpoint's state has {state_true} values; list their {state_true} joint "
                          f"names (sensor_msgs/JointState names, in the training data's order) in the config's "
                          f"action.state_joints (it has {len(joints)})")
    return joints


def _check_expert(shapes: dict, depth: int, q_out: int, kv_out: int, hf_dir: str) -> None:
    """pi0's action expert pairs with the language model layer by layer and shares its attention heads."""
    expert_depth = _layers(shapes, EXPERT + "model.")
    if expert_depth != depth:
        raise ConfigError(f"{hf_dir}: the action expert has {expert_depth} layers, the language model {depth}; "
                          f"pi0 pairs them layer by layer")
    e_q = _need(shapes, EXPERT + "model.layers.0.self_attn.q_proj.weight", hf_dir)
    e_k = _need(shapes, EXPERT + "model.layers.0.self_attn.k_proj.weight", hf_dir)
    if e_q[0] != q_out or e_k[0] != kv_out:
        raise ConfigError(f"{hf_dir}: the action expert's attention ({e_q[0]} / {e_k[0]} outputs) does not match "
                          f"the language model's ({q_out} / {kv_out})")


def _untied_head(files: dict) -> bool:
    """Whether the checkpoint holds PaliGemma's output head and its embedding table as two different matrices.
    LeRobot 0.4 ties them (the file holds the head alone); LeRobot 0.6's PaliGemma does not (both are saved and
    trained apart), which matters where logits are read (pi0-FAST)."""
    keys = {_key(k): k for k in files}
    if LM_HEAD not in keys or VLM + "embed_tokens.weight" not in keys:
        return False
    pair = dict(read_tensors({keys[n]: files[keys[n]] for n in (LM_HEAD, VLM + "embed_tokens.weight")}))
    head, table = pair[keys[LM_HEAD]], pair[keys[VLM + "embed_tokens.weight"]]
    return head.shape != table.shape or not bool((head == table).all())


def _pi0_fast_config(hf_dir, path, top, base, vision, llm, norms, prefix, max_instr, joints, max_state,
                     action_dim, prompt_state) -> ModelConfig:
    """pi0-FAST: the backbone generates FAST tokens after [cameras | <bos> prompt | <bos>] (``prefix`` positions);
    the cache holds them and ``max_decoding_steps`` more (rounded up to 8 positions: TensorRT's aligned KV views)."""
    if float(top.get("temperature", 0.0)) != 0.0:
        raise ConfigError(f"{path}: temperature {top['temperature']}: only greedy decoding (0) is supported")
    if not top.get("validate_action_token_prefix", True):
        raise ConfigError(f"{path}: validate_action_token_prefix: false is not supported (the tokens must start "
                          f"with 'Action:')")
    fast_dir = os.path.join(hf_dir, FAST_DIR)
    tokenizer, settings = os.path.join(fast_dir, "tokenizer.json"), os.path.join(fast_dir, "processor_config.json")
    if not (os.path.isfile(tokenizer) and os.path.isfile(settings)):
        raise ConfigError(f"{hf_dir}: the FAST action tokenizer is not in {fast_dir}: put the files of "
                          f"{top.get('action_tokenizer_name', 'physical-intelligence/fast')} (tokenizer.json, "
                          f"processor_config.json, tokenizer_config.json) there")
    fast = fast_settings(settings)
    clean = os.path.join(fast_dir, "tokenizer_config.json")
    steps = int(top.get("max_decoding_steps", 256))
    span = -(-(prefix + steps) // 8) * 8
    return base.with_overrides(
        mode="vla", vision=vision,
        llm={**llm, "prefill_buckets": [prefix], "decode_buckets": [span], "max_seq_len": span},
        action={"head_type": "autoregressive", "token_codec": "fast", "action_dim": action_dim, "output_dim": 0,
                "action_horizon": int(top.get("n_action_steps", top.get("chunk_size", 50))),
                "state_dim": max_state, "state_joints": joints, "state_input": "prompt", "prompt_state": prompt_state,
                "time_conditioning": "action_mlp", "expert_attention": "joint", "action_attention": "bidirectional",
                "num_bins": 256, "token_vocab_size": 0, "norm_q01": [], "norm_q99": [], "norm_mask": [], **norms,
                "fast_tokenizer": os.path.abspath(tokenizer), "fast_scale": fast["scale"],
                "fast_min_token": fast["min_token"], "fast_skip_tokens": int(top.get("fast_skip_tokens", 128)),
                "fast_clean_up_spaces": bool(read_json(clean).get("clean_up_tokenization_spaces", False))
                if os.path.isfile(clean) else False,
                "max_decoding_steps": steps},
        tokenizer={"max_instruction_tokens": max_instr, "prompt_template": PI0_FAST_PROMPT,
                   "instruction_bos": "<bos>", "prompt_end_token": "<bos>"},
    )


def _vision_names(key: str) -> str | None:
    """Checkpoint vision key (without VISION) -> VitVisionEncoder parameter name."""
    if key == "embeddings.position_embedding.weight":
        return "embeddings.position_embedding"
    if key.startswith("encoder.layers."):
        return "encoder." + key[len("encoder.layers."):]
    return key


def load_lerobot_pi0(hf_dir: str, lm, vision, expert=None) -> None:
    """Copy the checkpoint's weights (float32) into the language model (:class:`~.decoder.CausalLM`), the
    vision encoder and the action expert (none for pi0-FAST, which has none), each matched strictly by name and
    shape."""
    files, _ = _shapes(hf_dir)
    by_name = {_key(k): k for k in files}
    pi05 = getattr(expert, "adaptive", False)
    targets = {"language model": (lm, {}), "vision encoder": (vision, {})}
    if expert is not None:
        targets["action expert"] = (expert, {})
    skipped = (EXPERT + "lm_head.", EXPERT + "model.embed_tokens.")  # unused by pi0 at inference
    unexpected = []
    for name, key in by_name.items():
        if name.startswith(skipped) or name.endswith("rotary_emb.inv_freq"):
            continue
        if name.startswith(VLM):
            targets["language model"][1][key] = "model." + name[len(VLM):]
        elif name == LM_HEAD:
            if VLM + "embed_tokens.weight" not in by_name:  # the tied table, saved once under the head's name
                targets["language model"][1][key] = "model.embed_tokens.weight"
            elif not lm.llm.tie_word_embeddings:  # LeRobot 0.6's own head (pi0-FAST reads its logits)
                targets["language model"][1][key] = "lm_head.weight"
        elif name.startswith(VISION):
            targets["vision encoder"][1][key] = _vision_names(name[len(VISION):])
        elif name.startswith(PROJECTOR):
            targets["vision encoder"][1][key] = "multi_modal_projector." + name[len(PROJECTOR):]
        elif name.startswith(EXPERT + "model.") and expert is not None:
            targets["action expert"][1][key] = name[len(EXPERT + "model."):]
        elif pi05 and name.startswith("state_proj."):
            continue  # LeRobot's pi0.5 drops a state projection a checkpoint may carry
        elif pi05 and name.split(".")[0] in ("time_mlp_in", "time_mlp_out", "action_time_mlp_in",
                                             "action_time_mlp_out"):
            # pi0.5's time MLP (LeRobot renames action_time_mlp_* to it on load)
            targets["action expert"][1][key] = re.sub(r"^action_time_mlp_", "time_mlp_", name)
        elif expert is not None and (name.split(".")[0] in _PROJECTIONS or
                                     name.split(".")[0] in ("time_mlp_in", "time_mlp_out")):
            # older checkpoints name the action-time MLP time_mlp_* (LeRobot renames them on load)
            targets["action expert"][1][key] = re.sub(r"^time_mlp_", "action_time_mlp_", name)
        else:
            unexpected.append(key)
    if unexpected:
        what = "pi0-FAST" if expert is None else "pi0.5" if pi05 else "pi0"
        raise ConfigError(f"{hf_dir}: tensors that are not part of {what}: {sorted(unexpected)[:8]}")
    for what, (module, wanted) in targets.items():
        params = dict(module.named_parameters(remove_duplicate=False))
        untied = what == "language model" and not lm.llm.tie_word_embeddings
        expected = {n for n in params if not n.startswith(("rope_", "head_t"))
                    and (untied or not n.startswith("lm_head")) and not n.endswith(_EXPORT_LAYOUT)}
        if what == "action expert" and getattr(module, "state_proj", None) is None:
            expected = {n for n in expected if not n.startswith("state_proj")}
        copy_checked(params, files, wanted, expected, [], hf_dir, f"pi0's {what} of this config",
                     "build the config from the checkpoint (synflux-build --from-hf does)")
