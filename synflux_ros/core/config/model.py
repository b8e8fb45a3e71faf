"""Model configuration: one YAML file per model, loaded into validated dataclasses.

A bad value fails at load time with its field path and what is allowed, e.g.::

    ConfigError: vla_pi0.yaml: action.head_type: 'flow' is not allowed (choices: flow_matching, autoregressive)
    ConfigError: vlm_demo.yaml: llm.num_layerz: unknown field (choices: ...; did you mean 'num_layers'?)

Switching models means switching the YAML file; nothing in the code branches on file names.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import yaml



#: Largest ``width * height`` a decoded frame may have unless the caller passes another limit (the
#: default of the config field ``vision.max_input_pixels``): 4096 x 4096.
DEFAULT_MAX_INPUT_PIXELS = 4096 * 4096


def _pair(value: Any, name: str) -> tuple[int, int]:
    """Validate a ``(rows, cols)`` pair of positive integers."""
    try:
        a, b = (int(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a pair of integers (H, W), got {value!r}") from exc
    if a <= 0 or b <= 0 or (a, b) != tuple(value):
        raise ValueError(f"{name} must be positive integers (H, W), got {value!r}")
    return a, b


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    """Validate a per-channel triple of floats."""
    try:
        values = tuple(float(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be three numbers (R, G, B), got {value!r}") from exc
    if len(values) != 3:
        raise ValueError(f"{name} must be three numbers (R, G, B), got {value!r}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class PreprocessSpec:
    """Target geometry and normalisation of the model input.

    Attributes:
        resolution: ``(H, W)`` of the resized frame.
        tile_size: ``(th, tw)``; must divide ``resolution`` exactly.  The
            frame is cut into ``(H/th) * (W/tw)`` tiles in row-major order.
        resize: ``"letterbox"`` keeps the aspect ratio and centres the frame,
            filling the border with ``pad_value``; ``"letterbox_bottom_right"``
            puts it in the bottom-right corner, its sizes truncated (LeRobot
            SmolVLA's ``resize_with_pad``); ``"stretch"`` scales each axis
            independently.
        pad_value: border pixel value (0..255, before normalisation).
        mean, std: per-channel RGB normalisation, applied as
            ``(x / 255 - mean) / std``.
        interpolation: ``"bilinear"`` (half-pixel centres, no antialiasing,
            8-bit fixed point: within 1.5 grey levels of exact float
            bilinear) or ``"nearest"`` (about 3x faster).  Unused when the
            input already has the target resolution.
    """

    resolution: tuple[int, int]
    tile_size: tuple[int, int]
    resize: str = "letterbox"
    pad_value: int = 0
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    interpolation: str = "bilinear"

    RESIZE_MODES: ClassVar[tuple[str, ...]] = ("letterbox", "letterbox_bottom_right", "stretch")
    INTERPOLATIONS: ClassVar[tuple[str, ...]] = ("bilinear", "nearest")

    def __post_init__(self) -> None:
        res = _pair(self.resolution, "resolution")
        tile = _pair(self.tile_size, "tile_size")
        if res[0] % tile[0] or res[1] % tile[1]:
            raise ValueError(f"tile_size {tile} does not divide resolution {res} exactly")
        if self.resize not in self.RESIZE_MODES:
            raise ValueError(f"resize must be one of {self.RESIZE_MODES}, got {self.resize!r}")
        if self.interpolation not in self.INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be one of {self.INTERPOLATIONS}, got {self.interpolation!r}"
            )
        pad = self.pad_value
        if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or not 0 <= pad <= 255:
            raise ValueError(f"pad_value must be an integer in 0..255, got {self.pad_value!r}")
        mean, std = _triple(self.mean, "mean"), _triple(self.std, "std")
        if not all(np.isfinite(mean)) or not all(s > 0 and np.isfinite(s) for s in std):
            raise ValueError(f"mean must be finite and std positive, got mean {mean}, std {std}")
        for name, value in (("resolution", res), ("tile_size", tile), ("mean", mean),
                            ("std", std), ("pad_value", int(pad))):
            object.__setattr__(self, name, value)

    @property
    def grid(self) -> tuple[int, int]:
        """Number of tiles along each axis, ``(H/th, W/tw)``."""
        return self.resolution[0] // self.tile_size[0], self.resolution[1] // self.tile_size[1]

    @property
    def num_tiles(self) -> int:
        """Total number of tiles, ``(H/th) * (W/tw)``."""
        rows, cols = self.grid
        return rows * cols


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _spec(default=dataclasses.MISSING, *, choices=None, min=None, max=None, doc="", default_factory=None):
    meta = {"choices": choices, "min": min, "max": max, "doc": doc}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("float32", "float16")


def _is_topic_token(name: str) -> bool:
    """A ROS name token: letters, digits and '_', not starting with a digit."""
    return bool(name) and not name[0].isdigit() and all(c.isalnum() or c == "_" for c in name) and name.isascii()
TOKEN_ID_DTYPES = ("int64", "int32")


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """``vision``: the fixed input resolution, tiling and normalisation of the vision encoder."""
    resolution: tuple[int, int] = _spec((448, 448), min=1, doc="fixed input size [H, W] of the vision encoder")
    tile_size: tuple[int, int] = _spec((224, 224), min=1, doc="tile size [h, w]; must divide resolution")
    tokens_per_tile: int = _spec(256, min=1, doc="vision tokens produced per tile")
    resize: str = _spec("letterbox", choices=PreprocessSpec.RESIZE_MODES)
    interpolation: str = _spec("bilinear", choices=PreprocessSpec.INTERPOLATIONS,
                               doc="resampling when the camera size differs from the resolution")
    pad_value: int = _spec(0, min=0, max=255)
    mean: tuple[float, float, float] = _spec((0.5, 0.5, 0.5))
    std: tuple[float, float, float] = _spec((0.5, 0.5, 0.5))
    # Architecture of the vision tower (what synflux-build exports; the mock ignores it).
    architecture: str = _spec("vit", choices=("vit", "qwen3_vl"),
                              doc="vit: patch ViT pooled to tokens_per_tile; qwen3_vl: Qwen3-VL vision tower")
    token_merge: str = _spec("average", choices=("average", "pixel_shuffle"),
                             doc="vit: how the patch grid becomes tokens_per_tile tokens. average: mean of each "
                                 "block of patches; pixel_shuffle (SmolVLM's connector): each block's patches "
                                 "concatenated, row-major, into one token s*s times wider")
    projector_bias: bool = _spec(True, doc="vit: the projector to the LLM width has a bias (SmolVLM's has none)")
    output_scale: float = _spec(1.0, min=0.0, doc="vit: the vision tokens are multiplied by it (SmolVLA: "
                                                  "sqrt(llm.hidden_dim))")
    layer_norm_eps: float = _spec(1e-6, min=0.0, doc="vit: epsilon of the transformer's LayerNorms")
    patch_size: int = _spec(0, min=0, doc="0 = tile side / sqrt(tokens_per_tile) (vit)")
    hidden_dim: int = _spec(0, min=0, doc="vision transformer width (0 = llm.hidden_dim)")
    num_layers: int = _spec(2, min=1)
    num_heads: int = _spec(4, min=1)
    intermediate_size: int = _spec(0, min=0, doc="0 = 4 x hidden_dim")
    spatial_merge_size: int = _spec(2, min=1, doc="qwen3_vl: patches merged per side into one token")
    deepstack_layers: tuple[int, ...] = _spec(default_factory=tuple, doc="qwen3_vl: layers feeding DeepStack")
    max_input_pixels: int = _spec(DEFAULT_MAX_INPUT_PIXELS, min=1,
                                  doc="largest width*height of an incoming image (raw, compressed or a chat "
                                      "image), checked before it is decoded")
    cameras: tuple[str, ...] = _spec(
        default_factory=tuple, doc="VLA: camera names, in the order their tokens enter the prefix (each image runs "
                                   "through the vision encoder on its own; vla_node subscribes '<name>/image'); "
                                   "empty = one camera on 'image'")
    camera_max_skew: float = _spec(0.05, min=0.0, doc="VLA with several cameras: seconds another camera's image may "
                                                      "lie from the first camera's frame (by header stamps)")

    def __post_init__(self):
        if self.architecture != "vit":
            vit_only = [n for n, default in (("token_merge", "average"), ("projector_bias", True),
                                             ("output_scale", 1.0), ("layer_norm_eps", 1e-6))
                        if getattr(self, n) != default]
            if vit_only:
                raise ConfigError(f"vision.{vit_only[0]}: a vit option; {self.architecture} takes its own from the "
                                  f"checkpoint")
        for i, axis in enumerate(("height", "width")):
            if self.resolution[i] % self.tile_size[i]:
                raise ConfigError(
                    f"vision.tile_size: {self.tile_size[i]} does not divide the resolution {axis} "
                    f"{self.resolution[i]}")
        if any(s <= 0 for s in self.std):
            raise ConfigError(f"vision.std: values must be > 0, got {list(self.std)}")
        names = list(self.cameras)
        if len(set(names)) != len(names) or not all(_is_topic_token(n) for n in names):
            raise ConfigError(f"vision.cameras: names must be unique, non-empty and usable in a topic name "
                              f"(letters, digits, '_', not starting with a digit), got {names}")

    @property
    def num_cameras(self) -> int:
        """Images per VLA frame (one without ``cameras``)."""
        return max(1, len(self.cameras))

    @property
    def merged_grid(self) -> tuple[int, int]:
        """qwen3_vl: the rows and columns of one tile's token grid (tile side / (patch * merge))."""
        unit = self.patch_size * self.spatial_merge_size
        return self.tile_size[0] // unit, self.tile_size[1] // unit

    @property
    def num_deepstack(self) -> int:
        """DeepStack feature maps the vision encoder returns (qwen3_vl only)."""
        return len(self.deepstack_layers) if self.architecture == "qwen3_vl" else 0

    @property
    def num_tiles(self) -> int:
        return (self.resolution[0] // self.tile_size[0]) * (self.resolution[1] // self.tile_size[1])

    @property
    def num_tokens(self) -> int:
        return self.num_tiles * self.tokens_per_tile


@dataclass(frozen=True, kw_only=True)
class LLMConfig:
    """``llm``: the backbone's dimensions, prefill/decode buckets and KV-cache layout."""
    num_layers: int = _spec(min=1)
    hidden_dim: int = _spec(min=1)
    num_heads: int = _spec(min=1)
    num_kv_heads: int = _spec(0, min=0, doc="0 = num_heads (multi-head attention)")
    head_dim: int = _spec(0, min=0, doc="0 = hidden_dim / num_heads")
    vocab_size: int = _spec(min=1)
    prefill_buckets: tuple[int, ...] = _spec(min=1, doc="new-token counts of the prefill graphs")
    decode_buckets: tuple[int, ...] = _spec(
        min=1, doc="attention spans of the decode graphs (a flow-matching VLA: of its action expert graphs; it has "
                   "no decode graphs)")
    max_seq_len: int = _spec(min=1, doc="KV-cache positions per session")
    kv_dtype: str = _spec("float32", choices=DTYPES)
    token_id_dtype: str = _spec("int64", choices=TOKEN_ID_DTYPES,
                                doc="dtype of the graphs' input_ids (the embedding's Gather indices); int32 for "
                                    "the qnn backend")
    embed_scale: float = _spec(0.0, min=0.0, doc="token embeddings multiplied by it; 0 = the architecture's "
                                                 "(sqrt(hidden_dim) for the Gemma family, else 1)")
    # Architecture details used by synflux-build (the mock ignores them).
    architecture: str = _spec("qwen3", choices=("qwen3", "qwen2", "llama", "gemma", "gemma2", "gemma3"),
                              doc="qwen3: q/k RMSNorm; qwen2: q/k/v biases; llama: plain; gemma: (1+w) norms, GELU, "
                                  "scaled embeddings; gemma2: gemma with sandwich norms (after attention and MLP "
                                  "too); gemma3: gemma2 with q/k RMSNorm")
    query_pre_attn_scalar: float = _spec(0.0, min=0.0, doc="attention scores scaled by its inverse square root "
                                                            "(Gemma 2/3); 0 = head_dim")
    attn_logit_softcapping: float = _spec(0.0, min=0.0, doc="attention scores capped as cap * tanh(s / cap) "
                                                             "before the mask (Gemma 2); 0 = none")
    final_logit_softcapping: float = _spec(0.0, min=0.0, doc="logits capped as cap * tanh(z / cap) (Gemma 2); "
                                                              "0 = none")
    sliding_window: int = _spec(0, min=0, doc="layers of sliding_window_layers attend to the keys of the last "
                                              "sliding_window positions (the query's included) only")
    sliding_window_layers: tuple[int, ...] = _spec(default_factory=tuple, min=0,
                                                   doc="indices of the layers with the sliding window")
    rope_local_theta: float = _spec(0.0, min=0.0, doc="rope base of the sliding-window layers (Gemma 3), without "
                                                      "scaling; 0 = rope_theta with its scaling, as every layer")
    intermediate_size: int = _spec(0, min=0, doc="MLP width (0 = 4 x hidden_dim)")
    rope_theta: float = _spec(10000.0, min=1.0)
    mrope_section: tuple[int, ...] = _spec(
        default_factory=tuple, min=1,
        doc="multimodal rotary embedding (Qwen3-VL, interleaved): rotary frequencies per position axis "
            "[t, h, w], summing to head_dim / 2; empty = 1-D positions. The prefill and decode graphs then "
            "take position_ids [3, n]")
    rms_norm_eps: float = _spec(1e-6, min=0.0)
    prefill_attention: str = _spec("causal", choices=("causal", "bidirectional"),
                                   doc="bidirectional: the tokens of one prefill call all see each other (pi0's "
                                       "prefix: cameras and instruction); the whole prefix must fit one prefill "
                                       "bucket (VLA configs only)")
    tie_word_embeddings: bool = _spec(False)

    def __post_init__(self):
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_dim)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            if self.hidden_dim % self.num_heads:
                raise ConfigError(f"llm.head_dim: hidden_dim {self.hidden_dim} is not divisible by "
                                  f"num_heads {self.num_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_dim // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"llm.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        for name in ("prefill_buckets", "decode_buckets"):
            buckets = getattr(self, name)
            if not buckets:
                raise ConfigError(f"llm.{name}: at least one bucket is required")
            if list(buckets) != sorted(set(buckets)):
                raise ConfigError(f"llm.{name}: buckets must be strictly increasing, got {list(buckets)}")
            if buckets[-1] > self.max_seq_len:
                raise ConfigError(f"llm.{name}: bucket {buckets[-1]} exceeds max_seq_len {self.max_seq_len}")
        if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2):
            raise ConfigError(f"llm.mrope_section: three frequency counts [t, h, w] summing to head_dim / 2 "
                              f"({self.head_dim // 2}) are needed, got {list(self.mrope_section)}")
        if bool(self.sliding_window) != bool(self.sliding_window_layers):
            raise ConfigError("llm.sliding_window: the window and sliding_window_layers go together")
        if self.sliding_window_layers and (list(self.sliding_window_layers) != sorted(set(self.sliding_window_layers))
                                           or self.sliding_window_layers[-1] >= self.num_layers):
            raise ConfigError(f"llm.sliding_window_layers: strictly increasing layer indices below num_layers "
                              f"({self.num_layers}) are needed, got {list(self.sliding_window_layers)}")
        if self.sliding_window_layers and self.mrope_section:
            raise ConfigError("llm.sliding_window: not supported with multimodal positions (mrope_section)")
        if self.rope_local_theta and not self.sliding_window_layers:
            raise ConfigError("llm.rope_local_theta: a rope base for sliding-window layers, but there are none")
        if self.decode_buckets[-1] != self.max_seq_len:
            raise ConfigError(f"llm.decode_buckets: the largest bucket must equal max_seq_len "
                              f"({self.max_seq_len}) so every cache position can be decoded, "
                              f"got {list(self.decode_buckets)}")

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one session's KV cache: [layers, 2, kv_heads, max_seq, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, self.max_seq_len, self.head_dim)


@dataclass(frozen=True, kw_only=True)
class NormalizationConfig:
    """``action.state_norm`` / ``action.action_norm``: how a vector is mapped for the model and back, as
    LeRobot's normalizer does it (per dimension):

    * ``mean_std``: ``(x - mean) / (std + eps)``; back: ``y * std + mean``;
    * ``bounds`` (LeRobot's MIN_MAX, QUANTILES and QUANTILE10 with min/max, q01/q99 or q10/q90 as
      low/high): ``2 * (x - low) / d - 1`` with ``d = high - low`` (``eps`` where that is 0); back:
      ``(y + 1) * d / 2 + low``.
    """
    mode: str = _spec(choices=("mean_std", "bounds"))
    mean: tuple[float, ...] = _spec(default_factory=tuple, doc="mean_std: per-dimension mean")
    std: tuple[float, ...] = _spec(default_factory=tuple, doc="mean_std: per-dimension standard deviation")
    low: tuple[float, ...] = _spec(default_factory=tuple, doc="bounds: per-dimension lower bound (min, q01, q10)")
    high: tuple[float, ...] = _spec(default_factory=tuple, doc="bounds: per-dimension upper bound (max, q99, q90)")
    eps: float = _spec(1e-8, min=0.0)

    _RELATIVE_ERRORS = True  # its checks name its own fields; the loader prefixes where it sits

    def __post_init__(self):
        need = ("mean", "std") if self.mode == "mean_std" else ("low", "high")
        other = ("low", "high") if self.mode == "mean_std" else ("mean", "std")
        a, b = (getattr(self, n) for n in need)
        if not a or len(a) != len(b):
            raise ConfigError(f"{need[0]} / {need[1]}: mode {self.mode} needs both, with one value per dimension "
                              f"(got {len(a)} and {len(b)})")
        if any(getattr(self, n) for n in other):
            raise ConfigError(f"{other[0]} / {other[1]}: not used by mode {self.mode}")

    @property
    def dim(self) -> int:
        return len(self.mean or self.low)


@dataclass(frozen=True, kw_only=True)
class ActionConfig:
    """``action``: the VLA head (flow matching or action tokens), chunk shape and un-normalisation."""
    head_type: str = _spec(choices=("flow_matching", "autoregressive"))
    action_dim: int = _spec(min=1)
    action_horizon: int = _spec(min=1, doc="steps per chunk")
    step_period: float = _spec(0.02, min=1e-6, doc="seconds between two steps of a chunk")
    num_denoise_steps: int = _spec(10, min=1, doc="flow matching: Euler steps")
    seed: int = _spec(0, min=0, doc="flow matching: base seed of the initial noise")
    num_bins: int = _spec(256, min=2, doc="autoregressive: uniform bins over [-1, 1]")
    token_vocab_size: int = _spec(0, min=0, doc="autoregressive: vocabulary whose last num_bins ids are the "
                                                "action tokens (0 = llm.vocab_size; OpenVLA: 32000)")
    token_codec: str = _spec("bins", choices=("bins", "fast"),
                             doc="autoregressive: bins (OpenVLA): one token per value, a bin over [-1, 1]; fast "
                                 "(pi0-FAST): BPE tokens of the chunk's DCT coefficients, after 'Action: ', up to "
                                 "'|'")
    fast_tokenizer: str = _spec("", doc="fast: the FAST tokenizer.json (BPE over coefficient characters)")
    fast_scale: float = _spec(10.0, min=1e-9, doc="fast: DCT coefficients were multiplied by it before rounding")
    fast_min_token: int = _spec(0, doc="fast: the coefficient of character 0")
    fast_skip_tokens: int = _spec(128, min=0, doc="fast: ids below the end of the vocabulary that FAST tokens skip "
                                                  "(FAST token k is id base_vocab - 1 - skip - k)")
    fast_clean_up_spaces: bool = _spec(False, doc="fast: the FAST tokenizer's clean_up_tokenization_spaces")
    max_decoding_steps: int = _spec(256, min=1, doc="fast: most tokens generated per chunk")
    norm_q01: tuple[float, ...] = _spec(default_factory=tuple, doc="per-dimension 1st percentile")
    norm_q99: tuple[float, ...] = _spec(default_factory=tuple, doc="per-dimension 99th percentile")
    norm_mask: tuple[bool, ...] = _spec(default_factory=tuple, doc="False = keep the dimension as predicted")
    expert_hidden_dim: int = _spec(0, min=0, doc="flow matching: action-expert width (0 = llm.hidden_dim)")
    expert_intermediate_size: int = _spec(0, min=0, doc="flow matching: action-expert MLP width (0 = 4 x width)")
    state_dim: int = _spec(0, min=0, doc="flow matching: length of the robot-state vector the action expert takes "
                                         "as its state token (pi0: 32, zero-padded); 0 = no state input")
    state_joints: tuple[str, ...] = _spec(
        default_factory=tuple, doc="joint names whose sensor_msgs/JointState positions fill the state vector, in "
                                   "order (the rest is zero); required with state_dim")
    state_max_age: float = _spec(0.1, min=0.0, doc="seconds a joint state may be older than a camera frame (by "
                                                   "header stamps) and still be used for it")
    output_dim: int = _spec(0, min=0, doc="flow matching: action dimensions published, the first output_dim of "
                                          "action_dim (pi0 predicts 32, zero-padded); 0 = action_dim")
    state_norm: NormalizationConfig | None = _spec(
        None, doc="flow matching: normalisation of the state_joints values before they enter the model")
    action_norm: NormalizationConfig | None = _spec(
        None, doc="flow matching: un-normalisation of the output_dim published values")
    time_conditioning: str = _spec(
        "action_mlp", choices=("action_mlp", "adarms"),
        doc="flow matching: how the flow time enters the expert. action_mlp (pi0): joined with each action token "
            "by action_time_mlp; adarms (pi0.5): a time MLP whose output scales, shifts and gates every norm of the "
            "expert (adaptive RMSNorm)")
    state_input: str = _spec(
        "token", choices=("token", "prompt", "prefix"),
        doc="flow matching, with state_dim: token (pi0): the normalised state is the expert's state token; prompt "
            "(pi0.5): it is cut into 256 bins over [-1, 1] and written into the prompt, tokenizer.prompt_template's "
            "{state}; prefix (SmolVLA): the prefill graphs project it (state_proj) into the prefix's last row, "
            "which sees the whole prefix and which no other prefix row sees")
    expert_attention: str = _spec(
        "joint", choices=("joint", "cross_attn"),
        doc="flow matching: joint (pi0): every expert layer attends to its backbone layer's prefix keys/values and "
            "to the action tokens; cross_attn (SmolVLA): only layers l with l % self_attn_every_n_layers == 0 do, "
            "the others attend to the prefix alone, through keys/values their own k/v projections make of the "
            "cached ones")
    self_attn_every_n_layers: int = _spec(2, min=0, doc="flow matching, expert_attention cross_attn: every n-th "
                                                        "expert layer attends jointly (0: none)")
    action_attention: str = _spec(
        "bidirectional", choices=("bidirectional", "causal"),
        doc="flow matching: how the action tokens see each other (pi0: bidirectional; SmolVLA: causal)")

    def __post_init__(self):
        fast = self.head_type == "autoregressive" and self.token_codec == "fast"
        flow_fields = (self.time_conditioning, self.expert_attention, self.action_attention)
        if self.head_type != "flow_matching" and flow_fields != ("action_mlp", "joint", "bidirectional"):
            raise ConfigError("action.time_conditioning / expert_attention / action_attention: for flow_matching "
                              "heads only")
        if self.head_type != "flow_matching" and self.state_input != ("prompt" if fast and self.state_dim else "token"):
            raise ConfigError("action.state_input: an autoregressive head takes the state in its prompt only "
                              "(token_codec fast, state_input: prompt)")
        if fast and not self.fast_tokenizer:
            raise ConfigError("action.fast_tokenizer: token_codec fast needs the FAST tokenizer.json")
        if self.token_codec == "fast" and self.head_type != "autoregressive":
            raise ConfigError("action.token_codec: fast is a codec of autoregressive heads")
        if self.state_input == "prefix" and not self.state_dim:
            raise ConfigError("action.state_input: prefix projects the robot state into the prefix; set state_dim")
        if self.expert_attention == "cross_attn" and self.time_conditioning != "action_mlp":
            raise ConfigError("action.expert_attention: cross_attn goes with time_conditioning action_mlp (SmolVLA)")
        if self.expert_attention == "cross_attn" and self.state_token_dim:
            raise ConfigError("action.expert_attention: cross_attn layers take the action tokens alone: not with a "
                              "state token (state_input: token)")
        if self.action_attention == "causal" and self.state_token_dim:
            raise ConfigError("action.action_attention: causal action tokens with a state token (state_input: "
                              "token) are not supported")
        if self.state_input == "prompt" and not self.state_dim:
            raise ConfigError("action.state_input: prompt writes the robot state into the prompt; set state_dim")
        if self.state_dim:
            if self.head_type != "flow_matching" and not fast:
                raise ConfigError("action.state_dim: a robot-state input is supported for flow_matching heads and the "
                                  "fast codec only")
            if not self.state_joints or len(self.state_joints) > self.state_dim:
                raise ConfigError(f"action.state_joints: 1 to state_dim ({self.state_dim}) joint names are needed, "
                                  f"got {len(self.state_joints)}")
            if len(set(self.state_joints)) != len(self.state_joints) or not all(j.strip() for j in self.state_joints):
                raise ConfigError(f"action.state_joints: names must be unique and not empty, got "
                                  f"{list(self.state_joints)}")
        elif self.state_joints:
            raise ConfigError("action.state_joints: given without action.state_dim")
        if self.output_dim > self.action_dim:
            raise ConfigError(f"action.output_dim: {self.output_dim} exceeds action_dim {self.action_dim}")
        flow_only = [n for n in ("output_dim", "state_norm", "action_norm") if getattr(self, n)]
        if flow_only and self.head_type != "flow_matching" and not (fast and flow_only[0] != "output_dim"):
            raise ConfigError(f"action.{flow_only[0]}: supported for flow_matching heads (and state_norm / action_norm "
                              f"for the fast codec) only")
        if fast and (self.norm_q01 or self.num_bins != 256 or self.token_vocab_size):
            raise ConfigError("action.norm_q01 / num_bins / token_vocab_size: bins codec options; the fast codec "
                              "un-normalises with action_norm")
        if self.norm_q01 and self.published_dim != self.action_dim:
            raise ConfigError("action.norm_q01: not with output_dim (use action_norm, which applies after the cut)")
        if self.action_norm is not None:
            if self.norm_q01:
                raise ConfigError("action.action_norm: give it or norm_q01/norm_q99, not both")
            if self.action_norm.dim != self.published_dim:
                raise ConfigError(f"action.action_norm: {self.action_norm.dim} dimensions, the published actions "
                                  f"have {self.published_dim} (output_dim, else action_dim)")
        if self.state_norm is not None and self.state_norm.dim != len(self.state_joints):
            raise ConfigError(f"action.state_norm: {self.state_norm.dim} dimensions for {len(self.state_joints)} "
                              f"state_joints")
        for name in ("norm_q01", "norm_q99", "norm_mask"):
            v = getattr(self, name)
            if v and len(v) != self.action_dim:
                raise ConfigError(f"action.{name}: {len(v)} values given, action_dim is {self.action_dim}")
        if bool(self.norm_q01) != bool(self.norm_q99):
            raise ConfigError("action.norm_q01 / action.norm_q99: give both or neither")

    @property
    def published_dim(self) -> int:
        """Values per step of a published chunk."""
        return self.output_dim or self.action_dim

    @property
    def state_token_dim(self) -> int:
        """Length of the action expert's state input (pi0's state token); 0 when the state is not one."""
        return self.state_dim if self.state_input == "token" else 0

    @property
    def prefix_state_dim(self) -> int:
        """Length of the prefill graphs' state input (SmolVLA's state row); 0 when the state is not one."""
        return self.state_dim if self.state_input == "prefix" else 0

    def cross_attention_layer(self, layer: int) -> bool:
        """Whether expert layer ``layer`` attends to the prefix alone (``expert_attention: cross_attn``)."""
        n = self.self_attn_every_n_layers
        return self.expert_attention == "cross_attn" and not (n > 0 and layer % n == 0)


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """``text``: default generation limits and sampling of the chat service."""
    max_new_tokens: int = _spec(256, min=1)
    do_sample: bool = _spec(False)
    temperature: float = _spec(0.7, min=0.0, max=100.0)
    top_p: float = _spec(0.9, min=1e-6, max=1.0)
    eos_token_ids: tuple[int, ...] = _spec(default_factory=tuple, doc="empty = the tokenizer's eos")
    seed: int = _spec(0, min=0)


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """``tokenizer``: a tokenizer.json (else byte-level) and the VLA prompt template."""
    path: str = _spec("", doc="tokenizer.json; empty = byte-level tokenizer")
    prompt_template: str = _spec("{instruction}\n", doc="VLA: how an instruction becomes the text prompt")
    instruction_bos: str = _spec("", doc="VLA: a special token put before the instruction's tokens (LeRobot pi0's "
                                         "PaliGemma tokenizer adds '<bos>'); empty = none")
    max_instruction_tokens: int = _spec(0, min=0, doc="VLA: the instruction's tokens are cut to this many (LeRobot "
                                                      "pi0: tokenizer_max_length, 48); 0 = no cut")
    prompt_end_token: str = _spec("", doc="VLA: a special token appended after the cut prompt (pi0-FAST's second "
                                          "'<bos>'); empty = none")
    prompt_special_tokens: bool = _spec(False, doc="VLA: the prompt gets the special tokens tokenizer.json's "
                                                   "post-processor adds (transformers' tokenizer(text), as LeRobot's "
                                                   "SmolVLA tokenises)")
    chat_template: str = _spec("", doc="VLM: a chat template (.jinja file); empty = the checkpoint's (beside the "
                                       "tokenizer), else plain text completion for a text-only model's "
                                       "tokenizer without one (a base model), else the built-in ChatML")
    image_token: str = _spec("<|image_pad|>", doc="VLM: the token the chat template marks an image with; each "
                                                  "becomes the image's vision tokens")


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """``session``: how many chat sessions hold a KV slot, and what happens when all are taken."""
    max_sessions: int = _spec(4, min=1, doc="KV-cache slots = concurrent chat sessions")
    eviction: str = _spec("lru", choices=("lru", "refuse"), doc="when all slots are taken")
    reuse_kv_cache: bool = _spec(True, doc="False recomputes the whole history every turn")
    max_images_per_turn: int = _spec(4, min=0)
    max_prompt_bytes: int = _spec(64 * 1024, min=1, doc="largest prompt in UTF-8 bytes, checked before tokenising")


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """``executor``: the backend, its graph directory and options, simulated latencies for the mock."""
    backend: str = _spec("mock")
    graph_dir: str = _spec("", doc="directory of compiled graphs (manifest.json)")
    latency_ms: dict[str, float] = _spec(
        default_factory=dict, doc="mock: simulated device latency per graph name or prefix")
    options: dict[str, Any] = _spec(default_factory=dict, doc="backend-specific options")
    placement: dict[str, Any] = _spec(
        default_factory=dict,
        doc="graph kind -> 'backend[:device]' or {backend, options}: run those graphs on another executor")

    PLACEABLE = ("vision_encoder", "embed", "prefill", "decode", "action_expert")

    def __post_init__(self):
        for kind, where in self.placement.items():
            path = f"executor.placement.{kind}"
            if kind not in self.PLACEABLE:
                raise ConfigError(f"{path}: unknown graph kind{choices_hint(kind, self.PLACEABLE)}")
            placed = Placement.parse(where, path)
            if placed.backend == self.backend and not placed.options:
                raise ConfigError(f"{path}: {where!r} is the default executor; remove the entry")

    def placements(self) -> dict[str, "Placement"]:
        """Graph kind -> where it runs, for the kinds placed away from the default executor."""
        return {kind: Placement.parse(where, f"executor.placement.{kind}") for kind, where in self.placement.items()}


@dataclass(frozen=True)
class Placement:
    """Where a graph kind runs: a backend and its options (``device`` among them)."""
    backend: str
    options: tuple = ()  # sorted (key, value) pairs, so that equal placements share one executor

    @classmethod
    def parse(cls, where, path: str) -> "Placement":
        if isinstance(where, str) and where:
            backend, _, device = where.partition(":")
            return cls(backend, (("device", device),) if device else ())
        if isinstance(where, dict) and isinstance(where.get("backend"), str) and where["backend"]:
            unknown = set(where) - {"backend", "options"}
            if unknown:
                raise ConfigError(f"{path}: unknown field {sorted(unknown)[0]!r} (choices: backend, options)")
            options = where.get("options") or {}
            if not isinstance(options, dict):
                raise ConfigError(f"{path}.options: expected a mapping, got {options!r}")
            return cls(where["backend"], tuple(sorted(options.items())))
        raise ConfigError(f"{path}: expected 'backend[:device]' or {{backend: ..., options: {{...}}}}, "
                          f"got {where!r}")

    def __str__(self) -> str:
        device = dict(self.options).get("device", "")
        return f"{self.backend}:{device}" if device else self.backend


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """``pipeline``: depth of the queues between the VLA stages."""
    queue_depth: int = _spec(1, min=1, max=64, doc="frames waiting between two stages")


EXECUTION_MODES = ("auto", "replace", "rtc", "weighted_average", "average", "conservative", "latest_only",
                   "temporal_ensemble")
"""``execution.mode``: the merge functions are ``execution/merge.py``'s table, one per name but ``auto``."""
GUIDED_MODES = frozenset({"rtc"})
"""Modes whose plan steers the next inference (Real-Time Chunking): ``ExecutionConfig.guides_inference``."""


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    """``execution.limits``: what no command may exceed, per joint in ``execution.joints`` order (empty = no
    such limit). Units are the joints' (rad or m for positions)."""
    _RELATIVE_ERRORS = True
    position_min: tuple[float, ...] = _spec(default_factory=tuple, doc="lowest position per joint")
    position_max: tuple[float, ...] = _spec(default_factory=tuple, doc="highest position per joint")
    max_velocity: tuple[float, ...] = _spec(default_factory=tuple, doc="largest speed per joint (units/s) "
                                                                       "between two commands")
    max_acceleration: tuple[float, ...] = _spec(default_factory=tuple, doc="largest change of speed per joint "
                                                                           "(units/s^2) between two commands")
    max_deceleration: tuple[float, ...] = _spec(
        default_factory=tuple, doc="largest slowing down per joint (units/s^2); empty = max_acceleration. The "
                                   "command brakes at this rate in time to stop at a position limit")
    max_jerk: tuple[float, ...] = _spec(
        default_factory=tuple, doc="largest change of acceleration per joint (units/s^3) between two commands; "
                                   "empty = none. The lowest priority: braking in time for a limit overrides it")
    max_relative_target: tuple[float, ...] = _spec(
        default_factory=tuple, doc="largest distance of a command from the measured joint position (LeRobot's "
                                   "max_relative_target): one value for every joint, or one per joint")
    outside_at_enable: str = _spec("refuse", choices=("refuse", "move_inside"),
                                   doc="a joint measured outside its position limits when commands are enabled: "
                                       "refuse to enable, naming it (default), or start there and move inside "
                                       "within the velocity and acceleration limits")

    PER_JOINT = ("position_min", "position_max", "max_velocity", "max_acceleration", "max_deceleration",
                 "max_jerk")

    def check(self, joints: tuple[str, ...]) -> None:
        """ConfigError naming the field and the joint when the limits do not fit ``joints`` or contradict."""
        for name in self.PER_JOINT:
            v = getattr(self, name)
            if v and len(v) != len(joints):
                raise ConfigError(f"limits.{name}: {len(v)} values for {len(joints)} joints {list(joints)}")
            for i, value in enumerate(v):
                if value != value:  # NaN passes every comparison below
                    raise ConfigError(f"limits.{name}[{i}] ({joints[i]}): NaN")
        if bool(self.position_min) != bool(self.position_max):
            raise ConfigError("limits.position_min / position_max: give both or neither")
        for i, joint in enumerate(joints):
            if self.position_min and not self.position_min[i] < self.position_max[i]:
                raise ConfigError(f"limits: joint {joint!r} has position_min {self.position_min[i]} not below "
                                  f"position_max {self.position_max[i]}")
            for name in ("max_velocity", "max_acceleration", "max_deceleration", "max_jerk"):
                v = getattr(self, name)
                if v and not v[i] > 0:
                    raise ConfigError(f"limits.{name}: joint {joint!r} has {v[i]}, a limit must be above 0")
        if self.max_jerk and not self.max_acceleration:
            raise ConfigError("limits.max_jerk: give max_acceleration too (the jerk limits how fast the "
                              "acceleration changes, up to max_acceleration)")
        r = self.max_relative_target
        if r and len(r) not in (1, len(joints)):
            raise ConfigError(f"limits.max_relative_target: {len(r)} values, give 1 or one per joint "
                              f"({len(joints)})")
        for i, value in enumerate(r):
            if not value > 0:
                joint = joints[i] if len(r) > 1 else "every joint"
                if value != value:
                    raise ConfigError(f"limits.max_relative_target[{i}] ({joint}): NaN")
                raise ConfigError(f"limits.max_relative_target: {joint!r} has {value}, a limit must be above 0")


@dataclass(frozen=True, kw_only=True)
class ChunkValidation:
    """``execution.validate``: a whole chunk checked before it enters the plan (LeRobot #4240), from its steps
    ``step_period`` apart: one value for every joint, or one per joint; empty = not checked."""
    max_step: tuple[float, ...] = _spec(default_factory=tuple, doc="largest change between two steps (units)")
    max_velocity: tuple[float, ...] = _spec(default_factory=tuple, doc="units/s between two steps")
    max_acceleration: tuple[float, ...] = _spec(default_factory=tuple, doc="units/s^2 over three steps")
    max_jerk: tuple[float, ...] = _spec(default_factory=tuple, doc="units/s^3 over four steps")
    on_violation: str = _spec("refuse", choices=("refuse", "clip"),
                              doc="refuse the chunk (counted, the worst joint and step in the warning), or clip "
                                  "its steps to max_step and max_velocity (acceleration and jerk still refuse)")

    FIELDS = ("max_step", "max_velocity", "max_acceleration", "max_jerk")

    def check(self, joints: tuple[str, ...]) -> None:
        for name in self.FIELDS:
            v = getattr(self, name)
            if v and len(v) not in (1, len(joints)):
                raise ConfigError(f"validate.{name}: {len(v)} values, give 1 or one per joint ({len(joints)})")
            for i, value in enumerate(v):
                if not value > 0:  # NaN too
                    who = joints[i] if len(v) > 1 else "every joint"
                    raise ConfigError(f"validate.{name}[{i}] ({who}): {value}, a threshold must be above 0")


@dataclass(frozen=True, kw_only=True)
class RTCConfig:
    """``execution.rtc``: Real-Time Chunking of flow-matching heads (Black et al. 2025)."""
    guidance: str = _spec("lerobot", choices=("lerobot", "vjp"),
                          doc="lerobot: LeRobot 0.4.4's correction (the weighted error); vjp: the paper's "
                              "vector-Jacobian product through the action expert")
    schedule: str = _spec("linear", choices=("zeros", "ones", "linear", "exp"),
                          doc="prefix weights over the previous chunk's leftover")
    execution_horizon: int = _spec(10, min=1, doc="steps of the previous chunk that guide the new one")
    max_guidance_weight: float = _spec(10.0, min=1e-6, doc="clamp of the guidance weight (> 0)")


@dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    """``execution``: how action chunks become commands on the robot's clock (vla configs). Without
    ``joints`` the node publishes action chunks only."""
    _RELATIVE_ERRORS = True
    joints: tuple[str, ...] = _spec(default_factory=tuple, doc="commanded joints in action order, one per "
                                                                 "published action value; empty = no commands")
    mode: str = _spec("auto", choices=EXECUTION_MODES, doc="how a new chunk merges with the one executing (auto: "
                                                          "rtc for flow-matching heads with absolute actions, "
                                                          "else replace)")
    control_rate_hz: float = _spec(100.0, min=1.0, max=2000.0, doc="rate of joint_command")
    lookahead: float = _spec(0.0, min=0.0, doc="seconds added to the measured delay for the hop to the "
                                               "controller")
    interpolation: str = _spec("linear", choices=("linear", "cubic"), doc="between action steps")
    request: str = _spec("every_frame", choices=("every_frame", "threshold"),
                         doc="infer on every frame, or only when the queue is below chunk_size_threshold")
    chunk_size_threshold: float = _spec(0.5, min=0.0, max=1.0, doc="request: threshold; share of a chunk left")
    temporal_ensemble_coeff: float = _spec(0.01, min=0.0, doc="temporal_ensemble: weights exp(-m*i), i=0 the "
                                                              "oldest prediction")
    delta_mask: tuple[bool, ...] = _spec(default_factory=tuple, doc="per joint: true = the action is a delta "
                                                                    "against the joint state of its frame")
    autoenable: bool = _spec(False, doc="commands flow from the start (else after ~/enable)")
    chunk_timeout: float = _spec(1.0, min=0.0, doc="seconds without a fresh chunk before the watchdog holds "
                                                   "(0 = off)")
    state_timeout: float = _spec(0.25, min=0.0, doc="seconds a joint state may age before the watchdog holds "
                                                    "(0 = commands do not need a joint state)")
    on_timeout: str = _spec("hold", choices=("hold", "hold_exact", "safe_action"),
                            doc="what the watchdog commands: hold = brake to a stop within the limits; hold_exact "
                                "= repeat the last command (for controllers that brake themselves); "
                                "safe_action = go to safe_action within the limits, braking in time")
    safe_action: tuple[float, ...] = _spec(default_factory=tuple, doc="on_timeout safe_action: the position per "
                                                                      "joint moved to within the limits")
    limits: LimitsConfig = _spec(default_factory=LimitsConfig)
    validate: ChunkValidation = _spec(default_factory=ChunkValidation)
    rtc: RTCConfig = _spec(default_factory=RTCConfig)

    @property
    def guides_inference(self) -> bool:
        """The plan's model-space leftover steers the next chunk (``rtc``): the plan keeps the model's rows and
        each frame takes the guidance with it."""
        return self.mode in GUIDED_MODES

    def __post_init__(self):
        joints = self.joints
        if len(set(joints)) != len(joints) or not all(j.strip() for j in joints):
            raise ConfigError(f"joints: names must be unique and not empty, got {list(joints)}")
        if self.delta_mask and len(self.delta_mask) != len(joints):
            raise ConfigError(f"delta_mask: {len(self.delta_mask)} values for {len(joints)} joints")
        if self.on_timeout == "safe_action" and len(self.safe_action) != len(joints):
            raise ConfigError(f"safe_action: on_timeout safe_action needs one position per joint ({len(joints)}), "
                              f"got {len(self.safe_action)}")
        if self.guides_inference and any(self.delta_mask):
            raise ConfigError("mode: rtc steers the new chunk towards the last one in the model's action space, "
                              "which delta actions (delta_mask) do not share between frames")
        self.limits.check(joints)
        self.validate.check(joints)
        lo, hi = self.limits.position_min, self.limits.position_max
        for i, v in enumerate(self.safe_action):
            if lo and not lo[i] <= v <= hi[i]:
                raise ConfigError(f"safe_action: joint {joints[i]!r} at {v} lies outside its limits "
                                  f"[{lo[i]}, {hi[i]}]")


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """``executor.backend: remote``: the model runs on a ``synflux-serve`` endpoint. A vla config's node sends
    each frame to its policy endpoint (its images fitted to the model's resolution and JPEG-compressed, as
    configured); a vlm config's node sends each chat turn to its chat API."""
    url: str = _spec("", doc="the endpoint: ws:// or wss:// for a vla config (ws://gpu-server:8000/), the chat "
                             "API's base http:// or https:// for a vlm config (http://gpu-server:8000/v1)")
    api_key_file: str = _spec("", doc="file holding the endpoint's API key (relative: to the config file)")
    ca_file: str = _spec("", doc="the CA certificate (PEM) to trust for wss:// and https:// (relative: to the "
                                 "config file); empty = the system's trust store")
    connect_timeout: float = _spec(5.0, min=0.01, doc="seconds to open the connection")
    request_timeout: float = _spec(2.0, min=0.01, doc="seconds a chunk may take on the wire and the server")
    turn_timeout: float = _spec(120.0, min=0.01, doc="vlm: seconds a chat turn may take, from the request to "
                                                      "the reply's last piece")
    compression: str = _spec("jpeg", choices=("jpeg", "raw"), doc="how images travel (raw: uint8 arrays)")
    jpeg_quality: int = _spec(90, min=1, max=100)
    resize: bool = _spec(True, doc="downscale each image to fit the model's resolution before sending (the "
                                   "server letterboxes or stretches it as vision.resize says)")
    backoff_min: float = _spec(0.5, min=0.0, doc="seconds before the first reconnection attempt")
    backoff_max: float = _spec(10.0, min=0.0, doc="the longest wait between reconnection attempts")

    def __post_init__(self):
        if self.url and not self.url.startswith(("ws://", "wss://", "http://", "https://")):
            raise ConfigError(f"remote.url: {self.url!r} is not a ws://, wss://, http:// or https:// address")
        if self.backoff_max < self.backoff_min:
            raise ConfigError(f"remote.backoff_max: {self.backoff_max} is below remote.backoff_min "
                              f"{self.backoff_min}")


def _key_path(value, path: str) -> tuple[str, ...]:
    """An observation key: a string names a top-level key (it may hold '/', as DROID's keys do), a list of
    strings a path into nested maps (ALOHA's ``[images, cam_high]``)."""
    parts = [value] if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, str) and p for p in parts):
        raise ConfigError(f"{path}: expected a key (a string) or a path of keys (a list of strings), got {value!r}")
    return tuple(parts)


PROXY_WS_MAX_BYTES = 16 * 1024 * 1024
"""Ray Serve's HTTP proxy (its uvicorn's ``ws_max_size``, which Serve 2.60 leaves at the default and offers no
option for) closes a websocket whose message is larger with code 1009, before the replica sees it."""


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """How ``synflux-serve`` reads a policy request (openpi's observation dict) and bounds it. Each key is a
    string (a top-level key) or a list of strings (a path into nested maps)."""
    images: dict[str, Any] = _spec(default_factory=dict, doc="camera (a vision.cameras name, or 'image' for a "
                                   "one-camera model) -> its observation key; empty = observation/<camera>")
    state: tuple[Any, ...] = _spec(("observation/state",), doc="keys whose values, concatenated in order, are the "
                                   "robot state (action.state_joints order)")
    prompt: Any = _spec("prompt", doc="key of the instruction; a request without it keeps the last one")
    max_message_bytes: int = _spec(15 * 1024 * 1024, min=1024, max=PROXY_WS_MAX_BYTES,
                                   doc="largest request message; at most Ray's proxy's 16 MiB websocket limit, over "
                                       "which the proxy itself closes the connection (code 1009)")

    def __post_init__(self):
        for cam, key in self.images.items():
            _key_path(key, f"serve.images.{cam}")
        for i, key in enumerate(self.state):
            _key_path(key, f"serve.state[{i}]")
        _key_path(self.prompt, "serve.prompt")

    def image_keys(self, cameras: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
        """(camera, key path) per camera of the model, in its order."""
        names = cameras or ("image",)
        unknown = sorted(set(self.images) - set(names))
        if unknown:
            raise ConfigError(f"serve.images: {', '.join(unknown)} is not a camera of the model "
                              f"(cameras: {', '.join(names)})")
        return [(c, _key_path(self.images.get(c, f"observation/{c}"), f"serve.images.{c}")) for c in names]

    @property
    def state_keys(self) -> list[tuple[str, ...]]:
        return [_key_path(k, "serve.state") for k in self.state]

    @property
    def prompt_key(self) -> tuple[str, ...]:
        return _key_path(self.prompt, "serve.prompt")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One model YAML, validated: every field checked at load with its path and the allowed values."""
    name: str = _spec()
    mode: str = _spec(choices=("vla", "vlm"))
    vision: VisionConfig | None = _spec(None, doc="the vision encoder; none (no section, or null) = a text-only "
                                                   "chat model (mode vlm)")
    llm: LLMConfig = _spec()
    action: ActionConfig | None = _spec(None)
    text: TextConfig = _spec(default_factory=TextConfig)
    tokenizer: TokenizerConfig = _spec(default_factory=TokenizerConfig)
    session: SessionConfig = _spec(default_factory=SessionConfig)
    executor: ExecutorConfig = _spec(default_factory=ExecutorConfig)
    pipeline: PipelineConfig = _spec(default_factory=PipelineConfig)
    execution: ExecutionConfig = _spec(default_factory=ExecutionConfig)
    serve: ServeConfig = _spec(default_factory=ServeConfig)
    remote: RemoteConfig = _spec(default_factory=RemoteConfig)
    default_instruction: str = _spec("pick up the object")
    source: str = _spec("", doc="file the config was loaded from (set by the loader)")

    def __post_init__(self):
        if self.mode == "vla" and self.action is None:
            raise ConfigError("action: required when mode is 'vla'")
        if self.mode == "vla" and self.vision is None:
            raise ConfigError("vision: required when mode is 'vla' (only a vlm config may be text-only)")
        if self.action is not None and self.action.head_type == "autoregressive":
            vocab = self.action.token_vocab_size or self.llm.vocab_size
            if not self.action.num_bins <= vocab <= self.llm.vocab_size:
                raise ConfigError(f"action.token_vocab_size: {vocab} must lie between action.num_bins "
                                  f"({self.action.num_bins}) and llm.vocab_size ({self.llm.vocab_size})")
        if self.mode == "vla":
            in_prompt = self.action.state_input == "prompt"
            if ("{state}" in self.tokenizer.prompt_template) != in_prompt:
                raise ConfigError("tokenizer.prompt_template: {state} places the robot state in the prompt, which "
                                  "goes with action.state_input: prompt" + ("" if in_prompt else " only"))
        if self.action is not None and self.action.head_type == "flow_matching":
            if self.llm.architecture in ("gemma2", "gemma3"):
                raise ConfigError(f"llm.architecture: {self.llm.architecture}: the action expert of a flow-matching "
                                  f"head is built of the backbone's blocks, which it has for qwen3, qwen2, llama and "
                                  f"gemma only")
            decoder_only = [n for n in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                                        "sliding_window") if getattr(self.llm, n)]
            if decoder_only:
                raise ConfigError(f"llm.{decoder_only[0]}: a decoder feature the action expert of a flow-matching "
                                  f"head does not have")
            if self.action.expert_attention == "cross_attn" and self.llm.architecture not in ("llama", "gemma"):
                raise ConfigError(f"action.expert_attention: cross_attn layers are built for llama and gemma "
                                  f"backbones (no q/k norms, no biases), not {self.llm.architecture}")
            if self.action.state_input == "prefix" and self.llm.prefill_attention != "bidirectional":
                raise ConfigError("action.state_input: prefix puts the state in the last row of the prefix, which "
                                  "is prefilled in one call: set llm.prefill_attention: bidirectional")
        if self.llm.sliding_window and self.llm.prefill_attention == "bidirectional":
            raise ConfigError("llm.sliding_window: the window is causal (keys up to sliding_window back); not with "
                              "a bidirectional prefill")
        if self.llm.mrope_section:
            if self.mode != "vlm":
                raise ConfigError("llm.mrope_section: multimodal positions are supported for vlm configs only")
            if self.vision is not None and (self.vision.architecture != "qwen3_vl" or self.vision.num_tiles != 1):
                raise ConfigError("llm.mrope_section: image positions need vision.architecture qwen3_vl with one "
                                  "tile (tile_size equal to resolution)")
        if self.mode == "vla" and self.prefix_vision_tokens >= self.llm.max_seq_len:
            raise ConfigError(f"llm.max_seq_len: {self.llm.max_seq_len} leaves no room after "
                              f"{self.prefix_vision_tokens} vision tokens")
        if self.vision is not None and self.vision.cameras and self.mode != "vla":
            raise ConfigError("vision.cameras: several cameras per frame are for vla configs (a chat turn takes "
                              "its images from the request)")
        if self.execution.joints:
            if self.mode != "vla":
                raise ConfigError("execution.joints: commands are for vla configs")
            if len(self.execution.joints) != self.action.published_dim:
                raise ConfigError(f"execution.joints: {len(self.execution.joints)} joints for "
                                  f"{self.action.published_dim} action values per step (action.output_dim, "
                                  f"else action_dim)")
        if self.mode == "vla":
            self.serve.image_keys(self.vision.cameras)
        if self.executor.backend == "remote":
            if not self.remote.url:
                raise ConfigError("remote.url: executor.backend remote needs the endpoint's address")
            want = ("ws://", "wss://") if self.mode == "vla" else ("http://", "https://")
            if not self.remote.url.startswith(want):
                what = "policy endpoint (ws:// or wss://)" if self.mode == "vla" else \
                    "chat API's base (http:// or https://, e.g. http://gpu-server:8000/v1)"
                raise ConfigError(f"remote.url: a {self.mode} config reaches synflux-serve's {what}; got "
                                  f"{self.remote.url!r}")
        if self.execution.guides_inference and (self.action is None or self.action.head_type != "flow_matching"):
            raise ConfigError("execution.mode: rtc guides a flow-matching head; this model's head is "
                              f"{self.action.head_type if self.action else 'none'}")
        if self.llm.prefill_attention == "bidirectional":
            if self.mode != "vla":
                raise ConfigError("llm.prefill_attention: bidirectional prefixes are for vla configs (chat prefill "
                                  "must stay causal)")
            if self.prefix_vision_tokens + 1 > self.llm.prefill_buckets[-1]:
                raise ConfigError(f"llm.prefill_buckets: with bidirectional prefill attention the whole prefix "
                                  f"({self.prefix_vision_tokens} vision tokens and the instruction) must fit the "
                                  f"largest bucket, {self.llm.prefill_buckets[-1]}")

    @property
    def resolved_execution(self) -> ExecutionConfig:
        """``execution`` with ``mode: auto`` resolved: rtc for a flow-matching head with absolute actions (make
        bench-control: far smoother switches at about the plain chunk's cost), else replace."""
        if self.execution.mode != "auto":
            return self.execution
        flow = self.action is not None and self.action.head_type == "flow_matching"
        rtc = flow and not any(self.execution.delta_mask)
        return dataclasses.replace(self.execution, mode="rtc" if rtc else "replace")

    @property
    def prefix_state_dim(self) -> int:
        """Length of the prefill graphs' state input (a VLA with ``action.state_input: prefix``), else 0."""
        return self.action.prefix_state_dim if self.mode == "vla" and self.action is not None else 0

    @property
    def prefix_vision_tokens(self) -> int:
        """VLA: vision tokens at the start of every prefix (all cameras)."""
        return self.vision.num_tokens * self.vision.num_cameras if self.vision is not None else 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def hash(self) -> str:
        """Hash of everything that shapes the graphs (not the file name)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    # Fields that change no graph: runtime behaviour only.
    _RUNTIME_ONLY = {"action": ("step_period", "seed", "norm_q01", "norm_q99", "norm_mask", "state_joints",
                                "state_max_age", "output_dim", "state_norm", "action_norm", "token_codec",
                                "fast_tokenizer", "fast_scale", "fast_min_token", "fast_skip_tokens",
                                "fast_clean_up_spaces", "max_decoding_steps"),
                     "vision": ("resize", "pad_value", "interpolation", "mean", "std", "max_input_pixels", "cameras",
                                "camera_max_skew")}

    def relative_to_source(self, path: str) -> str:
        """``path`` (a file a field names) resolved against the config file's directory when it is relative and
        the config came from a file; else as it is."""
        if path and not os.path.isabs(path) and self.source:
            return os.path.join(os.path.dirname(self.source), path)
        return path

    def graph_hash(self) -> str:
        """Hash of what shapes and fills the graphs (vision, llm, action heads); a graph set built for
        one config can be reused by any config with the same graph hash."""
        d = self.to_dict()
        keep = {k: d[k] for k in ("mode", "vision", "llm", "action")}
        for section, fields in self._RUNTIME_ONLY.items():
            if keep.get(section):
                keep[section] = {k: v for k, v in keep[section].items() if k not in fields}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

    def with_overrides(self, **sections) -> "ModelConfig":
        """Return a copy with some fields replaced, e.g. ``executor={'backend': 'mock'}``."""
        raw = self.to_dict()
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        return from_dict(raw, source=self.source)


# ----------------------------------------------------------------------------------------------
# Generic loader: dict -> dataclass with type, choice and range checks and field paths in errors.

def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value, tp, path: str, meta: dict):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path, meta)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return _build(tp, value, path + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_convert(v, args[0], f"{path}[{i}]", meta) for i, v in enumerate(value)]
        else:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)} ({list(value)})")
            items = [_convert(v, a, f"{path}[{i}]", meta) for i, (v, a) in enumerate(zip(value, args))]
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): (_convert(v, args[1], f"{path}.{k}", {}) if args[1] is not Any else v)
                for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    elif tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{path}: {value!r} is not allowed (choices: {', '.join(meta['choices'])})")
    if isinstance(value, (int, float)):
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(f"{path}: {value!r} is below the minimum {meta['min']}")
        if meta.get("max") is not None and value > meta["max"]:
            raise ConfigError(f"{path}: {value!r} is above the maximum {meta['max']}")
    return value


def choices_hint(name, choices) -> str:
    """`` (choices: a, b; did you mean 'a'?)`` for a ``name`` that is not one of ``choices``: the one
    wording of every "unknown name" error (config fields, backends, backend options)."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(name), choices, n=1)
    return f" (choices: {', '.join(choices)}" + (f"; did you mean {close[0]!r}?" if close else "") + ")"


def _build(cls, raw: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{prefix}{key}: unknown field{choices_hint(key, fields)}")
    kwargs = {}
    for name, f in fields.items():
        path = prefix + name
        if name in raw:
            kwargs[name] = _convert(raw[name], hints[name], path, dict(f.metadata))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}: required field is missing")
    # __post_init__ checks raise ConfigError with their own field paths (relative ones for sections that can
    # sit in several places, prefixed here).
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if getattr(cls, "_RELATIVE_ERRORS", False):
            raise ConfigError(f"{prefix}{exc}") from None
        raise


def options_from_dict(cls, raw, prefix: str = "executor.options."):
    """Validate the mapping ``raw`` into the dataclass ``cls`` as a config section is validated (types, choices,
    ranges, unknown keys with "did you mean"), errors naming ``prefix`` + the field: how a backend checks the
    ``executor.options`` it takes."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.')}: expected a mapping, got {raw!r}")
    return _build(cls, raw, prefix)


def from_dict(raw: dict, source: str = "") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source or 'config'}: top level must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    raw.pop("source", None)
    try:
        cfg = _build(ModelConfig, raw, "")
    except ConfigError as exc:
        raise ConfigError(f"{os.path.basename(source)}: {exc}" if source else str(exc)) from None
    object.__setattr__(cfg, "source", source)
    return cfg


def load_config(path: str) -> ModelConfig:
    """Load and validate a model YAML file."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path, encoding="utf-8") as fh:
        try:
            raw = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return from_dict(raw or {}, source=os.path.abspath(path))


def describe_fields(cls=ModelConfig, prefix: str = "") -> list[str]:
    """One line per field: path, type, default, constraints (used by the docs and `--help`)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "source":
            continue
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            lines.extend(describe_fields(inner[0], prefix + f.name + "."))
            continue
        meta = f.metadata
        extra = []
        if meta.get("choices"):
            extra.append("choices: " + ", ".join(meta["choices"]))
        if meta.get("min") is not None:
            extra.append(f"min {meta['min']}")
        if meta.get("max") is not None:
            extra.append(f"max {meta['max']}")
        default = "required" if (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING) \
            else repr(f.default if f.default is not dataclasses.MISSING else f.default_factory())
        doc = meta.get("doc", "")
        lines.append(f"{prefix}{f.name} ({_type_name(tp)}; {default}{'; ' + '; '.join(extra) if extra else ''})"
                     f"{': ' + doc if doc else ''}")
    return lines
