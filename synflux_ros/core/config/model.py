"""Model configuration: one YAML file per model, loaded into validated dataclasses.

A bad value fails at load time with its field path and what is allowed, e.g.::

    ConfigError: vla_pi0.yaml: action.head_type: 'flow' is not allowed (choices: flow_matching, autoregressive)
    ConfigError: vlm_demo.yaml: llm.num_layerz: unknown field (choices: ...; did you mean 'num_layers'?)

Switching models means switching the YAML file; nothing in the code branches on file names.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass

import yaml

from .backbone import LLMConfig, TokenizerConfig, VisionConfig
from .execution import ExecutionConfig
from .heads import ActionConfig, TextConfig
from .schema import ConfigError, _build, _type_name, graph_values, setting
from .service import ExecutorConfig, PipelineConfig, RemoteConfig, ServeConfig, SessionConfig


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One model YAML, validated: every field checked at load with its path and the allowed values. The
    sections marked ``graph=False`` shape no graph (see ``graph_hash``)."""
    name: str = setting(graph=False)
    mode: str = setting(choices=("vla", "vlm"))
    vision: VisionConfig | None = setting(None, doc="the vision encoder; none (no section, or null) = a text-only "
                                                      "chat model (mode vlm)")
    llm: LLMConfig = setting()
    action: ActionConfig | None = setting(None)
    text: TextConfig = setting(default_factory=TextConfig, graph=False)
    tokenizer: TokenizerConfig = setting(default_factory=TokenizerConfig, graph=False)
    session: SessionConfig = setting(default_factory=SessionConfig, graph=False)
    executor: ExecutorConfig = setting(default_factory=ExecutorConfig, graph=False)
    pipeline: PipelineConfig = setting(default_factory=PipelineConfig, graph=False)
    execution: ExecutionConfig = setting(default_factory=ExecutionConfig, graph=False)  # but rtc_vjp_graphs
    serve: ServeConfig = setting(default_factory=ServeConfig, graph=False)
    remote: RemoteConfig = setting(default_factory=RemoteConfig, graph=False)
    default_instruction: str = setting("pick up the object", graph=False)
    source: str = setting("", doc="file the config was loaded from (set by the loader)", graph=False)

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
        if self.groot_dit:
            if self.vision.architecture != "qwen3_vl" or not self.llm.mrope_section:
                raise ConfigError("action.expert_type: dit (GR00T N1.7) reads a Qwen3-VL backbone: set "
                                  "vision.architecture qwen3_vl and llm.mrope_section")
            if self.llm.prefill_attention != "causal":
                raise ConfigError("llm.prefill_attention: GR00T N1.7's backbone is causal")
            if self.action.vl_layers and self.action.vl_heads * self.action.vl_head_dim != self.llm.hidden_dim:
                raise ConfigError(f"action.vl_heads x vl_head_dim: {self.action.vl_heads} x {self.action.vl_head_dim} "
                                  f"must equal llm.hidden_dim ({self.llm.hidden_dim})")
        elif self.action is not None and self.action.head_type == "flow_matching":
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
            if self.mode != "vlm" and not self.groot_dit:
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
        if self.execution.guides_inference and any(self.action.relative_mask):
            raise ConfigError("execution.mode: rtc steers the new chunk towards the last one in the model's action "
                              "space, which actions relative to each frame's state (action.relative_mask) do not "
                              "share between frames")
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
        rtc = flow and not any(self.execution.delta_mask) and not any(self.action.relative_mask)
        return dataclasses.replace(self.execution, mode="rtc" if rtc else "replace")

    @property
    def rtc_vjp_graphs(self) -> bool:
        """Whether the graph set holds RTC's vector-Jacobian graphs (``action_expert_vjp_<d>``, GR00T's
        ``dit_vjp_<p>``): a flow-matching VLA whose resolved execution mode guides inference, with
        ``execution.rtc.guidance: vjp``. What the graph contract reads of the execution section."""
        flow = self.mode == "vla" and self.action is not None and self.action.head_type == "flow_matching"
        return flow and self.resolved_execution.guides_inference and self.execution.rtc.guidance == "vjp"

    @property
    def groot_dit(self) -> bool:
        """A VLA whose head is GR00T N1.7's DiT (``action.expert_type: dit``): its prefill graphs return the
        backbone's last features instead of a KV cache."""
        return self.mode == "vla" and self.action is not None and self.action.expert_type == "dit"

    @property
    def vision_images_per_call(self) -> int:
        """Images one ``vision_encoder`` call takes: all cameras of a GR00T frame at once (each image attends
        only within itself, so one call equals one per camera, and the cameras share each operation's fixed
        cost), else one."""
        if self.groot_dit and self.vision is not None and self.vision.batch_cameras:
            return self.vision.num_cameras
        return 1

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
        """Hash of the whole config (not the file name)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def relative_to_source(self, path: str) -> str:
        """``path`` (a file a field names) resolved against the config file's directory when it is relative and
        the config came from a file; else as it is."""
        if path and not os.path.isabs(path) and self.source:
            return os.path.join(os.path.dirname(self.source), path)
        return path

    def graph_hash(self) -> str:
        """Hash of what shapes and fills the graphs: the fields ``setting`` leaves at ``graph=True`` (mode and
        most of vision, llm and action) and whether the set holds RTC's vjp graphs. A graph set built for one
        config can be reused by any config with the same graph hash. GR00T's vision encoder takes every camera, so
        there their count is hashed too."""
        keep = graph_values(self)
        if self.rtc_vjp_graphs:  # only then, so that the hash of every set without them stays what it was
            keep["rtc_vjp_graphs"] = True
        if self.vision_images_per_call > 1:  # likewise: the cameras' count shapes only a GR00T vision encoder
            keep["vision_images_per_call"] = self.vision_images_per_call
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
