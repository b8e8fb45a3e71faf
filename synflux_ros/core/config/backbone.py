"""The backbone's sections: ``vision`` (with ``PreprocessSpec``, the geometry a frame is fitted to), ``llm``
and ``tokenizer``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .schema import ConfigError, setting


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
            bilinear), ``"nearest"`` (about 3x faster) or ``"bicubic"``:
            Keys' cubic with a = -0.5, antialiased (when downscaling by s the
            kernel is stretched by s, its support widened from 2 to 2s input
            pixels), weights normalised to sum 1 over the taps inside the
            frame, in the 16-bit fixed point of torch's uint8 kernel with a
            uint8 result after each axis, width first: equal, pixel for pixel,
            to torchvision's ``v2.functional.resize(BICUBIC, antialias=True)``
            of a uint8 tensor on the CPU (LeRobot GR00T N1.7's geometry).
            Unused when the input already has the target resolution.
        crop_fraction: ``1.0`` (the default) keeps the whole frame.  Below 1
            (``"bicubic"`` and ``"stretch"`` only), the frame is first
            stretched to a square of ``crop_edge``, a centred window of
            ``round(crop_fraction * crop_edge)`` pixels per side is kept (its
            offset floored) and that window is resized to ``resolution``:
            LeRobot GR00T N1.7's centre crop (``230 / 256``).
        crop_edge: side of that first square (LeRobot GR00T's
            ``shortest_image_edge``); ``0`` = the height of ``resolution``.
            A positive value makes the two-step resize happen even with
            ``crop_fraction`` 1.
    """

    resolution: tuple[int, int]
    tile_size: tuple[int, int]
    resize: str = "letterbox"
    pad_value: int = 0
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    interpolation: str = "bilinear"
    crop_fraction: float = 1.0
    crop_edge: int = 0

    RESIZE_MODES: ClassVar[tuple[str, ...]] = ("letterbox", "letterbox_bottom_right", "stretch")
    INTERPOLATIONS: ClassVar[tuple[str, ...]] = ("bilinear", "nearest", "bicubic")

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
        try:
            fraction = float(self.crop_fraction)
        except (TypeError, ValueError):
            raise ValueError(f"crop_fraction must be a number in (0, 1], got {self.crop_fraction!r}") from None
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"crop_fraction must be a number in (0, 1], got {self.crop_fraction!r}")
        edge = self.crop_edge
        if isinstance(edge, bool) or not isinstance(edge, (int, np.integer)) or edge < 0:
            raise ValueError(f"crop_edge must be an integer >= 0, got {self.crop_edge!r}")
        if (fraction < 1.0 or edge) and (self.interpolation, self.resize) != ("bicubic", "stretch"):
            raise ValueError(f"crop_fraction {fraction} / crop_edge {edge} need interpolation 'bicubic' and resize "
                             f"'stretch', got {self.interpolation!r} and {self.resize!r}")
        pad = self.pad_value
        if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or not 0 <= pad <= 255:
            raise ValueError(f"pad_value must be an integer in 0..255, got {self.pad_value!r}")
        mean, std = _triple(self.mean, "mean"), _triple(self.std, "std")
        if not all(np.isfinite(mean)) or not all(s > 0 and np.isfinite(s) for s in std):
            raise ValueError(f"mean must be finite and std positive, got mean {mean}, std {std}")
        for name, value in (("resolution", res), ("tile_size", tile), ("mean", mean),
                            ("std", std), ("pad_value", int(pad)), ("crop_fraction", fraction),
                            ("crop_edge", int(edge))):
            object.__setattr__(self, name, value)

    @property
    def cropped(self) -> bool:
        """Whether the frame goes through the square resize and centre crop before the resize to resolution."""
        return self.crop_fraction < 1.0 or self.crop_edge > 0

    def crop_window(self) -> tuple[int, int, int]:
        """``(edge, offset, side)``: the square the frame is first stretched to, and the first row (and column)
        and side of the centred window kept from it: ``side = max(1, round(edge * crop_fraction))``,
        ``offset = (edge - side) // 2``."""
        edge = self.crop_edge or self.resolution[0]
        side = max(1, int(round(edge * self.crop_fraction)))
        return edge, (edge - side) // 2, side

    @property
    def grid(self) -> tuple[int, int]:
        """Number of tiles along each axis, ``(H/th, W/tw)``."""
        return self.resolution[0] // self.tile_size[0], self.resolution[1] // self.tile_size[1]

    @property
    def num_tiles(self) -> int:
        """Total number of tiles, ``(H/th) * (W/tw)``."""
        rows, cols = self.grid
        return rows * cols


DTYPES = ("float32", "float16")
TOKEN_ID_DTYPES = ("int64", "int32")


def _is_topic_token(name: str) -> bool:
    """A ROS name token: letters, digits and '_', not starting with a digit."""
    return bool(name) and not name[0].isdigit() and all(c.isalnum() or c == "_" for c in name) and name.isascii()


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """``vision``: the fixed input resolution, tiling and normalisation of the vision encoder."""
    resolution: tuple[int, int] = setting((448, 448), min=1, doc="fixed input size [H, W] of the vision encoder")
    tile_size: tuple[int, int] = setting((224, 224), min=1, doc="tile size [h, w]; must divide resolution")
    tokens_per_tile: int = setting(256, min=1, doc="vision tokens produced per tile")
    resize: str = setting("letterbox", choices=PreprocessSpec.RESIZE_MODES, graph=False)
    interpolation: str = setting("bilinear", choices=PreprocessSpec.INTERPOLATIONS,
                                  doc="resampling when the camera size differs from the resolution: bilinear, "
                                      "nearest, or bicubic (antialiased, torchvision's uint8 bicubic on the CPU: "
                                      "LeRobot GR00T N1.7's)", graph=False)
    crop_fraction: float = setting(1.0, min=0.0, max=1.0, graph=False,
                                   doc="below 1 (bicubic, stretch): the frame is stretched to a square of crop_edge, "
                                       "a centred window of round(crop_fraction * crop_edge) pixels per side kept "
                                       "(offset floored) and resized to the resolution (GR00T N1.7: 230/256 = "
                                       "0.8984375); 1 = no crop")
    crop_edge: int = setting(0, min=0, graph=False,
                             doc="side of the square before the centre crop (LeRobot GR00T's shortest_image_edge); "
                                 "0 = the resolution's height; > 0 resizes in two steps even without a crop")
    pad_value: int = setting(0, min=0, max=255, graph=False)
    mean: tuple[float, float, float] = setting((0.5, 0.5, 0.5), graph=False)
    std: tuple[float, float, float] = setting((0.5, 0.5, 0.5), graph=False)
    # Architecture of the vision tower (what synflux-build exports; the mock ignores it).
    architecture: str = setting("vit", choices=("vit", "qwen3_vl"),
                                 doc="vit: patch ViT pooled to tokens_per_tile; qwen3_vl: Qwen3-VL vision tower")
    token_merge: str = setting("average", choices=("average", "pixel_shuffle"),
                                doc="vit: how the patch grid becomes tokens_per_tile tokens. average: mean of each "
                                    "block of patches; pixel_shuffle (SmolVLM's connector): each block's patches "
                                    "concatenated, row-major, into one token s*s times wider")
    projector_bias: bool = setting(True, doc="vit: the projector to the LLM width has a bias (SmolVLM's has none)")
    output_scale: float = setting(1.0, min=0.0, doc="vit: the vision tokens are multiplied by it (SmolVLA: "
                                                     "sqrt(llm.hidden_dim))")
    layer_norm_eps: float = setting(1e-6, min=0.0, doc="vit: epsilon of the transformer's LayerNorms")
    patch_size: int = setting(0, min=0, doc="0 = tile side / sqrt(tokens_per_tile) (vit)")
    hidden_dim: int = setting(0, min=0, doc="vision transformer width (0 = llm.hidden_dim)")
    num_layers: int = setting(2, min=1)
    num_heads: int = setting(4, min=1)
    intermediate_size: int = setting(0, min=0, doc="0 = 4 x hidden_dim")
    spatial_merge_size: int = setting(2, min=1, doc="qwen3_vl: patches merged per side into one token")
    deepstack_layers: tuple[int, ...] = setting(default_factory=tuple, doc="qwen3_vl: layers feeding DeepStack")
    max_input_pixels: int = setting(DEFAULT_MAX_INPUT_PIXELS, min=1,
                                     doc="largest width*height of an incoming image (raw, compressed or a chat "
                                         "image), checked before it is decoded", graph=False)
    cameras: tuple[str, ...] = setting(
        default_factory=tuple, doc="VLA: camera names, in the order their tokens enter the prefix (each image is "
                                   "encoded on its own; vla_node subscribes '<name>/image'); "
                                   "empty = one camera on 'image'", graph=False)
    batch_cameras: bool = setting(
        True, graph=False, doc="GR00T N1.7 with several cameras: one vision encoder call takes them all (false: a "
                               "graph of one image, run per camera, as rknn-toolkit2 needs); hashed through "
                               "ModelConfig.vision_images_per_call")
    camera_max_skew: float = setting(0.05, min=0.0, graph=False,
                                     doc="VLA with several cameras: seconds another camera's image may lie from the "
                                         "first camera's frame (by header stamps)")

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
        if not 0.0 < self.crop_fraction <= 1.0:
            raise ConfigError(f"vision.crop_fraction: a fraction in (0, 1] is needed, got {self.crop_fraction}")
        if (self.crop_fraction < 1.0 or self.crop_edge) and (self.interpolation, self.resize) != ("bicubic",
                                                                                                    "stretch"):
            name = "crop_fraction" if self.crop_fraction < 1.0 else "crop_edge"
            raise ConfigError(f"vision.{name}: the centre crop needs interpolation bicubic and resize stretch, got "
                              f"{self.interpolation} and {self.resize}")
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
    num_layers: int = setting(min=1)
    hidden_dim: int = setting(min=1)
    num_heads: int = setting(min=1)
    num_kv_heads: int = setting(0, min=0, doc="0 = num_heads (multi-head attention)")
    head_dim: int = setting(0, min=0, doc="0 = hidden_dim / num_heads")
    vocab_size: int = setting(min=1)
    prefill_buckets: tuple[int, ...] = setting(min=1, doc="new-token counts of the prefill graphs")
    decode_buckets: tuple[int, ...] = setting(
        min=1, doc="attention spans of the decode graphs (a flow-matching VLA: of its action expert graphs; it has "
                   "no decode graphs)")
    max_seq_len: int = setting(min=1, doc="KV-cache positions per session")
    kv_dtype: str = setting("float32", choices=DTYPES)
    token_id_dtype: str = setting("int64", choices=TOKEN_ID_DTYPES,
                                   doc="dtype of the graphs' input_ids (the embedding's Gather indices); int32 for "
                                       "the qnn backend")
    embed_scale: float = setting(0.0, min=0.0, doc="token embeddings multiplied by it; 0 = the architecture's "
                                                    "(sqrt(hidden_dim) for the Gemma family, else 1)")
    # Architecture details used by synflux-build (the mock ignores them).
    architecture: str = setting("qwen3", choices=("qwen3", "qwen2", "llama", "gemma", "gemma2", "gemma3"),
                                 doc="qwen3: q/k RMSNorm; qwen2: q/k/v biases; llama: plain; gemma: (1+w) norms, GELU, "
                                     "scaled embeddings; gemma2: gemma with sandwich norms (after attention and MLP "
                                     "too); gemma3: gemma2 with q/k RMSNorm")
    query_pre_attn_scalar: float = setting(0.0, min=0.0, doc="attention scores scaled by its inverse square root "
                                                               "(Gemma 2/3); 0 = head_dim")
    attn_logit_softcapping: float = setting(0.0, min=0.0, doc="attention scores capped as cap * tanh(s / cap) "
                                                                "before the mask (Gemma 2); 0 = none")
    final_logit_softcapping: float = setting(0.0, min=0.0, doc="logits capped as cap * tanh(z / cap) (Gemma 2); "
                                                                 "0 = none")
    sliding_window: int = setting(0, min=0, doc="layers of sliding_window_layers attend to the keys of the last "
                                                 "sliding_window positions (the query's included) only")
    sliding_window_layers: tuple[int, ...] = setting(default_factory=tuple, min=0,
                                                      doc="indices of the layers with the sliding window")
    rope_local_theta: float = setting(0.0, min=0.0, doc="rope base of the sliding-window layers (Gemma 3), without "
                                                         "scaling; 0 = rope_theta with its scaling, as every layer")
    intermediate_size: int = setting(0, min=0, doc="MLP width (0 = 4 x hidden_dim)")
    rope_theta: float = setting(10000.0, min=1.0)
    mrope_section: tuple[int, ...] = setting(
        default_factory=tuple, min=1,
        doc="multimodal rotary embedding (Qwen3-VL, interleaved): rotary frequencies per position axis "
            "[t, h, w], summing to head_dim / 2; empty = 1-D positions. The prefill and decode graphs then "
            "take position_ids [3, n]")
    rms_norm_eps: float = setting(1e-6, min=0.0)
    prefill_attention: str = setting("causal", choices=("causal", "bidirectional"),
                                      doc="bidirectional: the tokens of one prefill call all see each other (pi0's "
                                          "prefix: cameras and instruction); the whole prefix must fit one prefill "
                                          "bucket (VLA configs only)")
    tie_word_embeddings: bool = setting(False)

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
class TokenizerConfig:
    """``tokenizer``: a tokenizer.json (else byte-level) and the VLA prompt template."""
    path: str = setting("", doc="tokenizer.json; empty = byte-level tokenizer")
    prompt_template: str = setting("{instruction}\n", doc="VLA: how an instruction becomes the text prompt")
    instruction_bos: str = setting("", doc="VLA: a special token put before the instruction's tokens (LeRobot pi0's "
                                            "PaliGemma tokenizer adds '<bos>'); empty = none")
    max_instruction_tokens: int = setting(0, min=0, doc="VLA: the instruction's tokens are cut to this many (LeRobot "
                                                         "pi0: tokenizer_max_length, 48); 0 = no cut")
    prompt_end_token: str = setting("", doc="VLA: a special token appended after the cut prompt (pi0-FAST's second "
                                             "'<bos>'); empty = none")
    prompt_special_tokens: bool = setting(False, doc="VLA: the prompt gets the special tokens tokenizer.json's "
                                                      "post-processor adds (transformers' tokenizer(text), as "
                                                      "LeRobot's SmolVLA tokenises)")
    chat_template: str = setting("", doc="VLM: a chat template (.jinja file); empty = the checkpoint's (beside the "
                                          "tokenizer), else plain text completion for a text-only model's "
                                          "tokenizer without one (a base model), else the built-in ChatML")
    image_token: str = setting("<|image_pad|>", doc="VLM: the token the chat template marks an image with; "
                                                     "each becomes the image's vision tokens")
