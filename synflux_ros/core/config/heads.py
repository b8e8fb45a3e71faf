"""The heads' sections: ``action`` (a VLA's flow-matching or action-token head, with the ``state_norm`` and
``action_norm`` normalisers) and ``text`` (a chat model's generation defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from .schema import ConfigError, setting


@dataclass(frozen=True, kw_only=True)
class NormalizationConfig:
    """``action.state_norm`` / ``action.action_norm``: how a vector is mapped for the model and back, as
    LeRobot's normalizer does it (per dimension):

    * ``mean_std``: ``(x - mean) / (std + eps)``; back: ``y * std + mean``;
    * ``bounds`` (LeRobot's MIN_MAX, QUANTILES and QUANTILE10 with min/max, q01/q99 or q10/q90 as
      low/high): ``2 * (x - low) / d - 1`` with ``d = high - low`` (``eps`` where that is 0); back:
      ``(y + 1) * d / 2 + low``.
    """
    mode: str = setting(choices=("mean_std", "bounds"))
    mean: tuple[float, ...] = setting(default_factory=tuple, doc="mean_std: per-dimension mean")
    std: tuple[float, ...] = setting(default_factory=tuple, doc="mean_std: per-dimension standard deviation")
    low: tuple[float, ...] = setting(default_factory=tuple, doc="bounds: per-dimension lower bound (min, q01, q10)")
    high: tuple[float, ...] = setting(default_factory=tuple, doc="bounds: per-dimension upper bound (max, q99, q90)")
    eps: float = setting(1e-8, min=0.0)
    clip: bool = setting(False, doc="bounds: GR00T's min-max: a normalised value is clipped to [-1, 1], a dimension "
                                     "whose bounds are equal maps to 0, and a model output is clipped to [-1, 1] "
                                     "before it is un-normalised")

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
        if self.clip and self.mode != "bounds":
            raise ConfigError("clip: for mode bounds only")

    @property
    def dim(self) -> int:
        return len(self.mean or self.low)


@dataclass(frozen=True, kw_only=True)
class ActionConfig:
    """``action``: the VLA head (flow matching or action tokens), chunk shape and un-normalisation."""
    head_type: str = setting(choices=("flow_matching", "autoregressive"))
    action_dim: int = setting(min=1)
    action_horizon: int = setting(min=1, doc="steps per chunk")
    step_period: float = setting(0.02, min=1e-6, doc="seconds between two steps of a chunk", graph=False)
    output_horizon: int = setting(0, min=0, graph=False,
                                  doc="steps published per chunk: the first output_horizon of the action_horizon "
                                      "the model predicts (GR00T: LeRobot's chunk_size / n_action_steps cut); 0 = "
                                      "action_horizon")
    num_denoise_steps: int = setting(10, min=1, doc="flow matching: Euler steps")
    seed: int = setting(0, min=0, doc="flow matching: base seed of the initial noise", graph=False)
    num_bins: int = setting(256, min=2, doc="autoregressive: uniform bins over [-1, 1]")
    token_vocab_size: int = setting(0, min=0, doc="autoregressive: vocabulary whose last num_bins ids are the "
                                                   "action tokens (0 = llm.vocab_size; OpenVLA: 32000)")
    token_codec: str = setting("bins", choices=("bins", "fast"),
                                doc="autoregressive: bins (OpenVLA): one token per value, a bin over [-1, 1]; fast "
                                    "(pi0-FAST): BPE tokens of the chunk's DCT coefficients, after 'Action: ', up to "
                                    "'|'", graph=False)
    fast_tokenizer: str = setting("", graph=False, doc="fast: the FAST tokenizer.json (BPE over coefficient "
                                                        "characters)")
    fast_scale: float = setting(10.0, min=1e-9, graph=False,
                                doc="fast: DCT coefficients were multiplied by it before rounding")
    fast_min_token: int = setting(0, doc="fast: the coefficient of character 0", graph=False)
    fast_skip_tokens: int = setting(128, min=0, doc="fast: ids below the end of the vocabulary that FAST tokens skip "
                                                     "(FAST token k is id base_vocab - 1 - skip - k)", graph=False)
    fast_clean_up_spaces: bool = setting(False, graph=False,
                                         doc="fast: the FAST tokenizer's clean_up_tokenization_spaces")
    max_decoding_steps: int = setting(256, min=1, doc="fast: most tokens generated per chunk", graph=False)
    norm_q01: tuple[float, ...] = setting(default_factory=tuple, doc="per-dimension 1st percentile", graph=False)
    norm_q99: tuple[float, ...] = setting(default_factory=tuple, doc="per-dimension 99th percentile", graph=False)
    norm_mask: tuple[bool, ...] = setting(default_factory=tuple, graph=False,
                                          doc="False = keep the dimension as predicted")
    expert_hidden_dim: int = setting(0, min=0, doc="flow matching: action-expert width (0 = llm.hidden_dim)")
    expert_intermediate_size: int = setting(0, min=0, doc="flow matching: action-expert MLP width (0 = 4 x width)")
    state_dim: int = setting(0, min=0, doc="flow matching: length of the robot-state vector the action expert takes "
                                            "as its state token (pi0: 32, zero-padded); 0 = no state input")
    state_joints: tuple[str, ...] = setting(
        default_factory=tuple, doc="joint names whose sensor_msgs/JointState positions fill the state vector, in "
                                   "order (the rest is zero); required with state_dim", graph=False)
    state_max_age: float = setting(0.1, min=0.0, doc="seconds a joint state may be older than a camera frame (by "
                                                      "header stamps) and still be used for it", graph=False)
    output_dim: int = setting(0, min=0, doc="flow matching: action dimensions published, the first output_dim of "
                                             "action_dim (pi0 predicts 32, zero-padded); 0 = action_dim", graph=False)
    state_norm: NormalizationConfig | None = setting(
        None, doc="flow matching: normalisation of the state_joints values before they enter the model", graph=False)
    action_norm: NormalizationConfig | None = setting(
        None, doc="flow matching: un-normalisation of the output_dim published values", graph=False)
    time_conditioning: str = setting(
        "action_mlp", choices=("action_mlp", "adarms"),
        doc="flow matching: how the flow time enters the expert. action_mlp (pi0): joined with each action token "
            "by action_time_mlp; adarms (pi0.5): a time MLP whose output scales, shifts and gates every norm of the "
            "expert (adaptive RMSNorm)")
    state_input: str = setting(
        "token", choices=("token", "prompt", "prefix"),
        doc="flow matching, with state_dim: token (pi0): the normalised state is the expert's state token; prompt "
            "(pi0.5): it is cut into 256 bins over [-1, 1] and written into the prompt, tokenizer.prompt_template's "
            "{state}; prefix (SmolVLA): the prefill graphs project it (state_proj) into the prefix's last row, "
            "which sees the whole prefix and which no other prefix row sees")
    relative_mask: tuple[bool, ...] = setting(
        default_factory=tuple, graph=False,
        doc="actions relative to the robot state (LeRobot's use_relative_actions): one value per published "
            "dimension; where true, the un-normalised action adds the frame's state_joints value of the same index "
            "(empty: absolute actions)")
    prompt_state: str = setting(
        "padded", choices=("padded", "joints"), graph=False,
        doc="state_input prompt: which values the prompt writes: padded, all state_dim of the zero-padded vector "
            "(openpi, LeRobot 0.4); joints, the state_joints values alone (LeRobot 0.5 and later)")
    expert_attention: str = setting(
        "joint", choices=("joint", "cross_attn"),
        doc="flow matching: joint (pi0): every expert layer attends to its backbone layer's prefix keys/values and "
            "to the action tokens; cross_attn (SmolVLA): only layers l with l % self_attn_every_n_layers == 0 do, "
            "the others attend to the prefix alone, through keys/values their own k/v projections make of the "
            "cached ones")
    self_attn_every_n_layers: int = setting(2, min=0, doc="flow matching, expert_attention cross_attn: every n-th "
                                                           "expert layer attends jointly (0: none)")
    action_attention: str = setting(
        "bidirectional", choices=("bidirectional", "causal"),
        doc="flow matching: how the action tokens see each other (pi0: bidirectional; SmolVLA: causal)")

    expert_type: str = setting(
        "llm", choices=("llm", "dit"),
        doc="flow matching: llm (pi0, SmolVLA): an action expert built of the backbone's decoder blocks, attending "
            "to the prefix's keys/values; dit (GR00T N1.7): the backbone's last-layer features pass a LayerNorm and "
            "vl_layers self-attention blocks once per frame, then a DiT of dit_layers blocks (cross-attention to "
            "them, to the text rows and the image rows in turn, then self-attention over [state, actions]) is "
            "integrated from t = 0 (noise) to 1 in num_denoise_steps steps, its time in time_buckets buckets")
    dit_layers: int = setting(0, min=0, doc="dit: DiT blocks (GR00T N1.7: 32)")
    dit_heads: int = setting(0, min=0, doc="dit: attention heads of a DiT block (32)")
    dit_head_dim: int = setting(0, min=0, doc="dit: width of a DiT head (48); the DiT's width is heads x head_dim")
    dit_hidden_dim: int = setting(0, min=0, doc="dit: the DiT's output width and that of the state encoder's and "
                                                 "action decoder's hidden layer (1024)")
    dit_text_every_n_blocks: int = setting(2, min=1, doc="dit: cross-attention block 2k attends to the text rows "
                                                          "when k is a multiple of it, else to the image rows")
    vl_layers: int = setting(0, min=0, doc="dit: self-attention blocks over the backbone features (4)")
    vl_heads: int = setting(0, min=0, doc="dit: their heads (32); heads x vl_head_dim = llm.hidden_dim")
    vl_head_dim: int = setting(0, min=0, doc="dit: their head width (64)")
    time_buckets: int = setting(1000, min=1, doc="dit: the flow time t in [0, 1) enters as the bucket int(t x it)")
    embodiment: int = setting(0, min=0, doc="dit: the embodiment id whose state encoder, action encoder and action "
                                             "decoder the graphs are built with (GR00T: new_embodiment = 10)")
    num_embodiments: int = setting(32, min=1, doc="dit: embodiments the checkpoint has encoders for")
    rtc_ramp_rate: float = setting(6.0, min=0.0, graph=False, doc="dit: Real-Time Chunking's ramp of the velocity "
                                                                   "over the rows after the frozen ones "
                                                                   "(1 - exp(-rate u), GR00T's rtc_ramp_rate)")
    formalize_language: bool = setting(True, graph=False, doc="dit: the instruction is lower-cased and kept to "
                                                               "letters, digits, spaces and underscores (GR00T's "
                                                               "formalize_language)")

    def __post_init__(self):
        fast = self.head_type == "autoregressive" and self.token_codec == "fast"
        self._check_dit()
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
        if self.relative_mask:
            if len(self.relative_mask) != self.published_dim:
                raise ConfigError(f"action.relative_mask: {len(self.relative_mask)} values for {self.published_dim} "
                                  f"published action values (output_dim, else action_dim)")
            if len(self.state_joints) < self.published_dim:
                raise ConfigError(f"action.relative_mask: each relative action adds the state value of its index; "
                                  f"the state has {len(self.state_joints)} joints for {self.published_dim} actions")
        if self.prompt_state != "padded" and self.state_input != "prompt":
            raise ConfigError("action.prompt_state: for a state written into the prompt (state_input: prompt) only")
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
        if self.output_horizon > self.action_horizon:
            raise ConfigError(f"action.output_horizon: {self.output_horizon} exceeds action_horizon "
                              f"{self.action_horizon}")
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

    def _check_dit(self) -> None:
        dit_fields = ("dit_layers", "dit_heads", "dit_head_dim", "dit_hidden_dim", "vl_heads", "vl_head_dim")
        if self.expert_type != "dit":
            given = [n for n in (*dit_fields, "vl_layers", "embodiment") if getattr(self, n)]
            if given:
                raise ConfigError(f"action.{given[0]}: for expert_type dit only")
            return
        if self.head_type != "flow_matching":
            raise ConfigError("action.expert_type: dit is a flow-matching head (head_type: flow_matching)")
        missing = [n for n in dit_fields if not getattr(self, n) and (n[:3] != "vl_" or self.vl_layers)]
        if missing:
            raise ConfigError(f"action.{missing[0]}: expert_type dit needs it (> 0)")
        if self.dit_layers % 2:
            raise ConfigError(f"action.dit_layers: {self.dit_layers}: the DiT's blocks come in pairs (cross-attention, "
                              f"then self-attention)")
        if not self.state_dim or self.state_input != "token":
            raise ConfigError("action.state_dim: expert_type dit encodes the robot state into its first token: set "
                              "state_dim (the checkpoint's max_state_dim) and state_input: token")
        if self.embodiment >= self.num_embodiments:
            raise ConfigError(f"action.embodiment: {self.embodiment} is not below num_embodiments "
                              f"({self.num_embodiments})")
        if (self.time_conditioning, self.expert_attention, self.action_attention) != ("action_mlp", "joint",
                                                                                        "bidirectional"):
            raise ConfigError("action.time_conditioning / expert_attention / action_attention: options of the llm "
                              "expert, not of expert_type dit")
        if self.relative_mask:
            raise ConfigError("action.relative_mask: not supported with expert_type dit")

    @property
    def dit_width(self) -> int:
        """The DiT's width (GR00T's input_embedding_dim)."""
        return self.dit_heads * self.dit_head_dim

    @property
    def dit_cross_blocks(self) -> int:
        """DiT blocks that cross-attend to the backbone features (the even ones)."""
        return self.dit_layers // 2

    @property
    def published_horizon(self) -> int:
        """Steps of a published chunk."""
        return self.output_horizon or self.action_horizon

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
    max_new_tokens: int = setting(256, min=1)
    do_sample: bool = setting(False)
    temperature: float = setting(0.7, min=0.0, max=100.0)
    top_p: float = setting(0.9, min=1e-6, max=1.0)
    eos_token_ids: tuple[int, ...] = setting(default_factory=tuple, doc="empty = the tokenizer's eos")
    seed: int = setting(0, min=0)
