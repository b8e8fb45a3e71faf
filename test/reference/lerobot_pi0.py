#!/usr/bin/env python3
"""LeRobot's π0 (``lerobot.policies.pi0``) and π0.5 (``lerobot.policies.pi05``) as the references the project's
π0 and π0.5 are compared with, in release 0.4.4 or 0.6.1: whichever the interpreter has.

Run it with the interpreter of ``.venv-pi0ref`` (``make pi0ref-venv``): torch 2.13 CPU, stock transformers
4.53.2 and lerobot 0.4.4 installed without its dependencies (see requirements-pi0ref.txt); or of
``.venv-lerobot06`` (``make lerobot06-venv``): lerobot 0.6.1 on Python 3.12, torch 2.11 and transformers 5.5.4,
whose π0 family runs on stock transformers (LeRobot's own ``pi_gemma``), so the compatibility layer below is not
installed there (see requirements-lerobot06.txt). Each release saves checkpoints in its own layout.

Subcommands
    check            import LeRobot's π0 and π0.5 here and run a minute model of each once (the venv's smoke test)
    make-checkpoint  build a small π0 (or, with --policy pi05, π0.5) with random weights and save it as a checkpoint
                     directory of the installed LeRobot (0.6.1: --relative-actions true saves use_relative_actions)
    run              load such a checkpoint with LeRobot and compute one action chunk from an .npz of inputs
                     (with --rtc, also the chunks LeRobot's Real-Time Chunking guides towards given leftovers);
                     the policy is the one config.json names ("type": "pi0" or "pi05")

Why a compatibility layer is needed
    LeRobot 0.4.4's π0 and π0.5 require ``transformers @ git+…@fix/lerobot_openpi``, a branch that exists only on
    GitHub: stock transformers 4.53.2 plus openpi's ``transformers_replace`` files. Both refuse to build unless
    ``transformers.models.siglip.check`` exists, and they rely on the branch's semantics, which differ from stock
    4.53.2 in exactly these places on their inference paths:

    * ``GemmaModel.forward`` does not multiply its input embeddings by sqrt(hidden_size) (π0 scales the language
      embeddings itself and feeds unscaled image and action embeddings), accepts ``adarms_cond`` and, when given
      a cache with ``use_cache=False``, attends to the cached keys/values followed by the new ones without
      writing the new ones into the cache: the prefix cache is reused unchanged by every denoising step.
    * ``PaliGemmaModel.get_image_features`` does not divide the projected image features by
      sqrt(text hidden_size).
    * ``GemmaRMSNorm`` called with ``cond=`` returns ``(output, gate)``; ``modeling_gemma._gated_residual``
      exists. π0 uses both only in its joint (training) forward.
    * Adaptive RMSNorm (π0.5's action expert, a Gemma config with ``use_adarms=True`` and ``adarms_cond_dim``):
      each decoder layer's two norms and the final norm have no ``weight`` but ``dense = Linear(cond_dim,
      3 * width)``; with a condition c they return ``(normed * (1 + scale) + shift, gate)`` where
      ``scale, shift, gate = dense(c)`` (broadcast over the sequence), and the decoder layer adds each sub-block
      as ``x + out * gate``. π0.5 feeds its time embedding as c on every denoising step.
    * In bfloat16 the Gemma and SigLIP encoders cast their inputs to bfloat16 first.

    ``install_transformers_shim`` patches these into stock transformers 4.53.2 at run time. When the branch
    itself is installed (``transformers.models.siglip.check`` is importable) nothing is patched, so the same
    script also runs LeRobot's policies on the real branch, which is how the shim was validated.

The small models
    The sizes come only from the variant names in the config ("gemma_2b" for the VLM, "gemma_300m" for the
    action expert) and a SigLIP-So400m vision config hard-coded in LeRobot, so LeRobot's config.json cannot
    describe a small model. make-checkpoint therefore writes ``tiny_dims.json`` beside it, and run (like
    make-checkpoint) patches LeRobot's ``get_gemma_config`` and the vision config from it before building the
    policy. A checkpoint without tiny_dims.json is loaded at the real sizes. The vocabulary stays 257152
    (hard-coded in LeRobot).

tiny_dims.json
    {"format": 1, "seed": int, "vocab_size": 257152, ["policy": "pi05",]
     "vlm":    {"variant": "gemma_2b",   "width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"},
     "expert": {"variant": "gemma_300m", "width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"},
     "vision": {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
                "image_size", "num_image_tokens"}}
    ("variant" is the name in config.json whose sizes the entry replaces; the vision projection width is
    vlm.width; "policy" is absent for π0.)

π0.5
    π0.5 has no state projection: the state reaches the model only as text. LeRobot's preprocessor normalises
    it (QUANTILES by default), pads it to max_state_dim, cuts [-1, 1] into 256 bins and builds the prompt
    ``"Task: <task>, State: <bins>;\\nAction: "``, which the PaliGemma tokenizer turns into the language tokens.
    As for π0 the tokenizer is not loaded: run takes the token ids from the inputs and reports the prompt LeRobot
    built (``"prompt"``, for the task given by --task) and the normalised, padded state it discretised
    (``"state_normalized"``), so the caller can check that its ids encode that prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import types
import zlib
from functools import partial
from pathlib import Path

import numpy as np

# Nothing here may reach the Hugging Face Hub: checkpoints are local directories and the tokenizer is not loaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DIMS_FILE = "tiny_dims.json"
VOCAB_SIZE = 257152  # hard-coded in LeRobot's PaliGemmaWithExpertModel
PATCH_SIZE = 14  # SigLIP So400m/14
TOKENIZER_STEP = "tokenizer_processor"
DEFAULT_TASK = "pick up the object"  # the task π0.5's prompt states unless run is given --task
# The Gemma tokenizer pads with id 0; LeRobot tokenises with padding="max_length", padding_side="right".
PAD_TOKEN_ID = 0

# --------------------------------------------------------------------------------------------------------------
# torchvision placeholder
#
# lerobot imports torchvision at module level on the way to π0 (lerobot.datasets.utils, lerobot.datasets.transforms,
# lerobot.processor.hil_processor) but π0's path never calls it. The only torchvision built for torch 2.13 on the
# registry is a CUDA build whose operators cannot load against the CPU torch, so when no torchvision is installed
# the imports are served with empty modules. Any attribute is a class (LeRobot subclasses v2.Transform at import
# time) that raises as soon as it is instantiated, so an unexpected use fails loudly instead of silently.


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = partial(_placeholder_attribute, module)
        return module

    def exec_module(self, module):
        pass


def _placeholder_attribute(module: types.ModuleType, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    qualname = f"{module.__name__}.{name}"

    def unavailable(*_args, **_kwargs):
        raise RuntimeError(f"{qualname} was used, but torchvision is not installed in the π0 reference environment")

    placeholder = type(name, (), {"__init__": unavailable, "__module__": module.__name__})
    setattr(module, name, placeholder)
    return placeholder


def install_torchvision_placeholder() -> bool:
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _TorchvisionPlaceholder())
    return True


# --------------------------------------------------------------------------------------------------------------
# The transformers shim: the fix/lerobot_openpi branch's π0 and π0.5 semantics on stock transformers 4.53.2.

SHIM_TRANSFORMERS_VERSION = "4.53.2"
CHECK_MODULE = "transformers.models.siglip.check"  # π0 imports it to verify the branch is installed
_NO_COND = object()  # GemmaRMSNorm called without cond= (stock callers) returns a tensor, not a tuple


class _ReadOnlyCache:
    """What a Gemma attention layer sees of the prefix cache during a denoising step.

    Stock GemmaAttention always calls ``past_key_value.update(k, v, layer_idx, ...)`` and attends to what it
    returns. The branch instead concatenates the cached keys/values with the new ones and leaves the cache alone
    when use_cache=False; this view gives the layers that result without storing anything.
    """

    def __init__(self, cache):
        self._cache = cache

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        import torch

        cached_keys, cached_values = self._cache[layer_idx]
        return torch.cat([cached_keys, key_states], dim=2), torch.cat([cached_values, value_states], dim=2)

    def __getitem__(self, layer_idx):
        return self._cache[layer_idx]

    def __len__(self):
        return len(self._cache)

    def get_seq_length(self, layer_idx=0):
        return self._cache.get_seq_length(layer_idx)


def _adarms_cond_dim(config):
    """The condition width of a Gemma config's adaptive norms, or None when its norms are plain (π0, π0.5's VLM)."""
    return getattr(config, "adarms_cond_dim", None) if getattr(config, "use_adarms", False) else None


def _wrap_rms_norm_init(stock_init):
    """GemmaRMSNorm(dim, eps, cond_dim=None) as on the branch: with cond_dim the norm has no ``weight`` but
    ``dense = Linear(cond_dim, 3 * dim)`` (zero weights, as the branch initialises it); without, it is stock's."""

    def __init__(self, dim, eps=1e-6, cond_dim=None):
        from torch import nn

        if cond_dim is None:
            stock_init(self, dim, eps=eps)
            return
        nn.Module.__init__(self)
        self.eps = eps
        self.dim = dim
        self.cond_dim = cond_dim
        self.dense = nn.Linear(cond_dim, 3 * dim, bias=True)
        nn.init.zeros_(self.dense.weight)

    return __init__


def _rms_norm_extra_repr(self):
    if getattr(self, "dense", None) is not None:
        return f"{self.dim}, eps={self.eps}, adaptive=True, cond_dim={self.cond_dim}"
    return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _rms_norm_forward(self, x, cond=_NO_COND):
    """GemmaRMSNorm as on the branch: the (1 + w) scale in float32, and ``(out, gate)`` when called with cond=.

    In float32 the plain norm's arithmetic equals stock 4.53.2; the difference is the return type. An adaptive
    norm (one with ``dense``) given a condition scales and shifts the normalised input by ``dense(cond)`` in float32
    and returns the third part of it as the gate of the residual that follows.
    """
    import torch

    variance = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
    dense = getattr(self, "dense", None)
    if cond is _NO_COND or cond is None or dense is None:
        if dense is not None:
            raise ValueError("an adaptive RMSNorm (use_adarms) needs its condition: call it with cond=")
        out = (x * torch.rsqrt(variance + self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return out if cond is _NO_COND else (out, None)
    if cond.shape[-1] != self.cond_dim:
        raise ValueError(f"Expected cond dimension {self.cond_dim}, got {cond.shape[-1]}")
    modulation = dense(cond)
    if x.ndim == 3:
        modulation = modulation.unsqueeze(1)  # one condition per sequence, broadcast over its tokens
    scale, shift, gate = torch.chunk(modulation, 3, dim=-1)
    normed = x * torch.rsqrt(variance + self.eps)
    out = normed * (1 + scale.to(torch.float32)) + shift.to(torch.float32)
    return out.to(x.dtype), gate.to(x.dtype)


def _gated_residual(x, y, gate):
    """The branch's residual helper: x + y, or x + y * gate after an adaptive norm."""
    if x is None or y is None:
        return y if x is None else x
    return x + y if gate is None else x + y * gate


def _wrap_decoder_layer_init(stock_init):
    """GemmaDecoderLayer with adaptive input and post-attention norms when its config sets use_adarms."""

    def __init__(self, config, layer_idx):
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        stock_init(self, config, layer_idx)
        cond_dim = _adarms_cond_dim(config)
        if cond_dim is not None:
            self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)
            self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                         cond_dim=cond_dim)

    return __init__


def _wrap_gemma_model_init(stock_init):
    """GemmaModel with an adaptive final norm when its config sets use_adarms (the layers build their own)."""

    def __init__(self, config):
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        stock_init(self, config)
        cond_dim = _adarms_cond_dim(config)
        if cond_dim is not None:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, cond_dim=cond_dim)

    return __init__


def _wrap_gemma_init_weights(stock_init_weights):
    """Stock initialisation sets every GemmaRMSNorm's weight; an adaptive norm has none (its dense is a Linear)."""

    def _init_weights(self, module):
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        if isinstance(module, GemmaRMSNorm) and getattr(module, "dense", None) is not None:
            return
        stock_init_weights(self, module)

    return _init_weights


def _wrap_decoder_layer_forward(stock_forward):
    """GemmaDecoderLayer.forward taking ``adarms_cond``: without it the stock layer runs unchanged; with it each
    sub-block is normalised by the adaptive norm and added back through the norm's gate, as on the branch."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None, position_embeddings=None,
                adarms_cond=None, **kwargs):
        if adarms_cond is None:
            return stock_forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_value=past_key_value, output_attentions=output_attentions,
                                 use_cache=use_cache, cache_position=cache_position,
                                 position_embeddings=position_embeddings, **kwargs)
        residual = hidden_states
        hidden_states, gate = self.input_layernorm(hidden_states, cond=adarms_cond)
        hidden_states, attn_weights = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = _gated_residual(residual, hidden_states, gate)
        residual = hidden_states
        hidden_states, gate = self.post_attention_layernorm(hidden_states, cond=adarms_cond)
        hidden_states = _gated_residual(residual, self.mlp(hidden_states), gate)
        return (hidden_states, attn_weights) if output_attentions else (hidden_states,)

    return forward


def _gemma_model_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    use_cache=None,
    output_attentions=None,
    output_hidden_states=None,
    cache_position=None,
    adarms_cond=None,
    **kwargs,
):
    """GemmaModel.forward with the branch's semantics (see the module docstring).

    The decoder layers, rotary embedding and final norm are the stock modules; what differs from stock is that
    the embeddings are not scaled, the mask given by π0 (4-D, additive) reaches the layers unchanged, a cache
    passed with use_cache=False is read but not written, and ``adarms_cond`` (π0.5's expert) conditions every
    adaptive norm, the final one included.
    """
    import torch
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast

    if adarms_cond is None and _adarms_cond_dim(self.config) is not None:
        raise ValueError("a Gemma model with adaptive RMSNorm (use_adarms) needs adarms_cond")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    cfg = self.config
    output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
    output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
    use_cache = cfg.use_cache if use_cache is None else use_cache
    if self.gradient_checkpointing and self.training:
        use_cache = False

    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache()
    if cache_position is None:
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(seen, seen + inputs_embeds.shape[1], device=inputs_embeds.device)
    if position_ids is None:
        position_ids = cache_position.unsqueeze(0)
    # A 4-D mask (all π0 passes) is returned as it is; anything else gets stock's causal mask.
    mask = create_causal_mask(
        config=cfg,
        input_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache_position=cache_position,
        past_key_values=past_key_values,
        position_ids=position_ids,
    )
    layer_cache = past_key_values
    if past_key_values is not None and not use_cache:
        layer_cache = _ReadOnlyCache(past_key_values)

    hidden = inputs_embeds  # not multiplied by sqrt(hidden_size)
    if len(self.layers) and self.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
        hidden = hidden.to(torch.bfloat16)
    position_embeddings = self.rotary_emb(hidden, position_ids)

    all_hidden = () if output_hidden_states else None
    all_attn = () if output_attentions else None
    if adarms_cond is not None:
        kwargs = {**kwargs, "adarms_cond": adarms_cond}
    for layer in self.layers[: cfg.num_hidden_layers]:
        if output_hidden_states:
            all_hidden += (hidden,)
        out = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_value=layer_cache,
            output_attentions=output_attentions,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden = out[0]
        if output_attentions:
            all_attn += (out[1],)
    if adarms_cond is None:
        hidden = self.norm(hidden)
    else:
        hidden, _ = self.norm(hidden, cond=adarms_cond)
    if output_hidden_states:
        all_hidden += (hidden,)
    return BaseModelOutputWithPast(
        last_hidden_state=hidden,
        past_key_values=past_key_values if use_cache else None,
        hidden_states=all_hidden,
        attentions=all_attn,
    )


def _image_features_unscaled(self, pixel_values):
    """PaliGemmaModel.get_image_features without stock's division by sqrt(text hidden_size)."""
    return self.multi_modal_projector(self.vision_tower(pixel_values).last_hidden_state)


def _wrap_siglip_encoder_forward(stock_forward):
    """The branch casts SigLIP's embeddings (kept float32 by π0's bfloat16 mode) to bfloat16 before the encoder."""
    import torch

    def forward(self, inputs_embeds, *args, **kwargs):
        if len(self.layers) and self.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
            inputs_embeds = inputs_embeds.to(torch.bfloat16)
        return stock_forward(self, inputs_embeds, *args, **kwargs)

    return forward


def branch_installed() -> bool:
    """True when transformers is the fix/lerobot_openpi branch (or openpi's files copied over 4.53.2)."""
    if CHECK_MODULE in sys.modules:
        return not getattr(sys.modules[CHECK_MODULE], "_pi0_reference_shim", False)
    return importlib.util.find_spec(CHECK_MODULE) is not None


def install_transformers_shim(mode: str = "auto") -> str:
    """Give stock transformers the branch's π0/π0.5 semantics. Returns which semantics are in force.

    mode "auto": patch unless the branch is installed; "on": patch (stock transformers required); "off": leave
    transformers alone (LeRobot's π0 and π0.5 then refuse stock transformers).
    """
    import transformers

    if mode == "off":
        return "untouched"
    if branch_installed():
        if mode == "on":
            raise RuntimeError("the patched transformers branch is installed; the shim is for stock transformers")
        return "branch"
    if transformers.__version__ != SHIM_TRANSFORMERS_VERSION:
        raise RuntimeError(
            f"the π0 reference shim is written against transformers {SHIM_TRANSFORMERS_VERSION}, "
            f"found {transformers.__version__}"
        )
    from transformers.models.gemma import modeling_gemma
    from transformers.models.paligemma import modeling_paligemma
    from transformers.models.siglip import modeling_siglip

    if getattr(sys.modules.get(CHECK_MODULE), "_pi0_reference_shim", False):
        return "shim"  # installed before

    check = types.ModuleType(CHECK_MODULE)
    check.__doc__ = "Stands in for the branch's module, which π0 imports to verify the installation."
    check.__spec__ = importlib.machinery.ModuleSpec(check.__name__, None)
    check._pi0_reference_shim = True
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True
    sys.modules[check.__name__] = check
    transformers.models.siglip.check = check

    modeling_gemma.GemmaRMSNorm.__init__ = _wrap_rms_norm_init(modeling_gemma.GemmaRMSNorm.__init__)
    modeling_gemma.GemmaRMSNorm.forward = _rms_norm_forward
    modeling_gemma.GemmaRMSNorm.extra_repr = _rms_norm_extra_repr
    modeling_gemma._gated_residual = _gated_residual
    layer = modeling_gemma.GemmaDecoderLayer
    layer.__init__ = _wrap_decoder_layer_init(layer.__init__)
    layer.forward = _wrap_decoder_layer_forward(layer.forward)
    modeling_gemma.GemmaModel.__init__ = _wrap_gemma_model_init(modeling_gemma.GemmaModel.__init__)
    pretrained = modeling_gemma.GemmaPreTrainedModel
    pretrained._init_weights = _wrap_gemma_init_weights(pretrained._init_weights)
    modeling_gemma.GemmaModel.forward = _gemma_model_forward
    modeling_paligemma.PaliGemmaModel.get_image_features = _image_features_unscaled
    modeling_siglip.SiglipEncoder.forward = _wrap_siglip_encoder_forward(modeling_siglip.SiglipEncoder.forward)
    return "shim"


def lerobot_06() -> bool:
    """Whether the installed LeRobot is 0.5 or later (0.6.1 in ``.venv-lerobot06``): its π0 family runs on stock
    transformers 5 through its own ``pi_gemma`` module, so nothing is patched."""
    from importlib.metadata import version

    return tuple(int(p) for p in version("lerobot").split(".")[:2]) >= (0, 5)


def prepare_lerobot(shim_mode: str) -> str:
    """Everything needed before LeRobot's π0/π0.5 modules are imported; returns the semantics in force."""
    install_torchvision_placeholder()
    if lerobot_06():
        return "stock"
    return install_transformers_shim(shim_mode)


# --------------------------------------------------------------------------------------------------------------
# Small sizes


POLICIES = ("pi0", "pi05")


def policy_modules(policy: str):
    """LeRobot's modeling module, policy class, config class and processor factory of ``policy``."""
    if policy == "pi0":
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as config_cls
        from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors as make_processors

        return modeling, modeling.PI0Policy, config_cls, make_processors
    if policy == "pi05":
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as config_cls
        from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors as make_processors

        return modeling, modeling.PI05Policy, config_cls, make_processors
    raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")


def apply_model_dims(dims: dict) -> None:
    """Make LeRobot build the policy at the sizes of ``dims`` (the tiny_dims.json format) instead of the real ones.

    LeRobot looks up ``get_gemma_config`` and ``PaliGemmaForConditionalGeneration`` in the policy's modeling module
    at call time, so replacing both there is enough: the first maps the two variant names to the small Gemma sizes,
    the second rewrites the vision config that PaliGemmaWithExpertModel hard-codes to SigLIP So400m.
    """
    patch_model_dims(policy_modules(dims.get("policy", "pi0"))[0], dims)


def patch_model_dims(modeling, dims: dict, set_image_size: bool = False) -> None:
    """apply_model_dims on the LeRobot modeling module ``modeling``: the Gemma variants are those of the parts of
    ``dims`` present ("vlm", and "expert" where the policy has an action expert). With ``set_image_size`` the vision
    config's image_size becomes dims' too (π0 and π0.5 set it from their config themselves)."""
    gemma = {}
    for part in ("vlm", "expert"):
        if part not in dims:
            continue
        d = dims[part]
        gemma[d["variant"]] = modeling.GemmaConfig(
            width=d["width"],
            depth=d["depth"],
            mlp_dim=d["mlp_dim"],
            num_heads=d["num_heads"],
            num_kv_heads=d["num_kv_heads"],
            head_dim=d["head_dim"],
        )

    def get_gemma_config(variant):
        if variant not in gemma:
            raise ValueError(f"{DIMS_FILE} has no sizes for variant {variant!r}")
        return gemma[variant]

    # LeRobot 0.4 builds PaliGemmaForConditionalGeneration, 0.5+ its PaliGemmaForConditionalGenerationWithPiGemma
    attribute = next(a for a in ("PaliGemmaForConditionalGenerationWithPiGemma", "PaliGemmaForConditionalGeneration")
                     if getattr(modeling, a, None) is not None)
    paligemma_cls = getattr(modeling, "_stock_paligemma_cls", getattr(modeling, attribute))
    modeling._stock_paligemma_cls = paligemma_cls
    vision = dims["vision"]

    def build_paligemma(config):
        vc = config.vision_config
        if set_image_size:
            vc.image_size = vision["image_size"]
        vc.hidden_size = vision["hidden_size"]
        vc.num_hidden_layers = vision["num_hidden_layers"]
        vc.num_attention_heads = vision["num_attention_heads"]
        vc.intermediate_size = vision["intermediate_size"]
        vc.patch_size = vision["patch_size"]
        vc.projection_dim = dims["vlm"]["width"]
        config.projection_dim = dims["vlm"]["width"]
        config.text_config.num_image_tokens = (vc.image_size // vc.patch_size) ** 2
        return paligemma_cls(config=config)

    modeling.get_gemma_config = get_gemma_config
    setattr(modeling, attribute, build_paligemma)


def read_dims(checkpoint: Path) -> dict | None:
    path = checkpoint / DIMS_FILE
    if not path.exists():
        return None
    dims = json.loads(path.read_text())
    if dims.get("format") != 1:
        raise ValueError(f"{path}: unknown format {dims.get('format')!r}")
    if dims.get("policy", "pi0") not in POLICIES:
        raise ValueError(f"{path}: unknown policy {dims['policy']!r}")
    return dims


# --------------------------------------------------------------------------------------------------------------
# make-checkpoint

CHECKPOINT_DEFAULTS = {
    "policy": "pi0",
    "seed": 0,
    "vlm_width": 64,
    "depth": 2,
    "vlm_mlp_dim": 128,
    "expert_width": 48,
    "expert_mlp_dim": 96,
    "num_heads": 8,
    "num_kv_heads": 1,
    "head_dim": 16,
    "vision_width": 32,
    "vision_depth": 2,
    "vision_heads": 4,
    "vision_mlp_dim": 64,
    "image_size": 56,
    "cameras": ["base"],
    "state_dim": 8,
    "action_dim": 6,
    "max_state_dim": 32,
    "max_action_dim": 32,
    "chunk_size": 10,
    "n_action_steps": None,  # None: chunk_size
    "num_inference_steps": 10,
    "tokenizer_max_length": None,  # None: the policy's default (π0 48, π0.5 200)
    "state_norm": None,  # None: the policy's default (POLICY_NORMS)
    "action_norm": None,
    "dtype": "float32",
    "relative_actions": False,  # LeRobot 0.5+: use_relative_actions (the chunk relative to the state)
    "action_names": None,  # LeRobot 0.5+: action_feature_names, which relative_exclude_joints (gripper) match
}
NORM_MODES = ("MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10", "IDENTITY")
# The state and action normalisation each policy gets unless told: MEAN_STD for π0 (as this script always made it),
# LeRobot's own default QUANTILES for π0.5.
POLICY_NORMS = {"pi0": "MEAN_STD", "pi05": "QUANTILES"}


def gather_options(args, defaults: dict) -> dict:
    """``defaults``, then the --options JSON (inline or @file), then explicit flags; cameras split at commas."""
    opts = dict(defaults)
    if args.options:
        text = Path(args.options[1:]).read_text() if args.options.startswith("@") else args.options
        given = json.loads(text)
        unknown = sorted(set(given) - set(opts))
        if unknown:
            raise SystemExit(f"unknown options: {', '.join(unknown)}")
        opts.update(given)
    for key in defaults:
        value = getattr(args, key, None)
        if value is not None:
            opts[key] = value
    for key in ("cameras", "action_names"):
        if isinstance(opts.get(key), str):
            opts[key] = [c for c in opts[key].split(",") if c]
    return opts


def checkpoint_options(args, defaults: dict | None = None, validate=None) -> dict:
    """Defaults (π0's, or a policy's own ``defaults`` checked by its ``validate``), then the --options JSON (inline
    or @file), then explicit flags; n_action_steps defaults to chunk_size, the norms to the policy's."""
    opts = gather_options(args, CHECKPOINT_DEFAULTS if defaults is None else defaults)
    if opts["n_action_steps"] is None:
        opts["n_action_steps"] = opts["chunk_size"]
    for key in ("state_norm", "action_norm"):
        if opts[key] is None:
            opts[key] = POLICY_NORMS.get(opts.get("policy"), "MEAN_STD")
    (validate or validate_options)(opts)
    return opts


def feature_config(opts: dict) -> dict:
    """The config fields of a small LeRobot policy's features: its cameras (square images of ``image_size``), its
    state and action sizes and their normalisation modes; on the CPU."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    size = opts["image_size"]
    inputs = {f"observation.images.{cam}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, size, size))
              for cam in opts["cameras"]}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(opts["state_dim"],))
    return {"input_features": inputs,
            "output_features": {"action": PolicyFeature(type=FeatureType.ACTION, shape=(opts["action_dim"],))},
            "normalization_mapping": {"VISUAL": NormalizationMode.IDENTITY,
                                      "STATE": NormalizationMode(opts["state_norm"]),
                                      "ACTION": NormalizationMode(opts["action_norm"])},
            "device": "cpu"}


def dataset_stats(opts: dict) -> dict:
    """Seeded statistics of the state and the actions, for every normalisation mode."""
    rng = np.random.default_rng(opts["seed"])
    return {"observation.state": make_stats(rng, opts["state_dim"]), "action": make_stats(rng, opts["action_dim"])}


def save_checkpoint(out: Path, policy, preprocessor, postprocessor, dims: dict, dims_file: str = DIMS_FILE) -> None:
    """The policy and its processors saved by LeRobot, and the sidecar of the sizes LeRobot's config cannot name."""
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out)
    preprocessor.save_pretrained(out)
    postprocessor.save_pretrained(out)
    (out / dims_file).write_text(json.dumps(dims, indent=2) + "\n")


def add_run_flags(rn: argparse.ArgumentParser) -> None:
    """The ``run`` subcommand's flags every flow-matching policy's runner shares: where the chunk goes, the
    Real-Time Chunking cases, timing, threads."""
    rn.add_argument("--out", help=".npz to write: actions [chunk, action dim] float32, actions_normalized, "
                                  "state_normalized, lang_tokens, lang_mask")
    rn.add_argument("--rtc", metavar="JSON", help="Real-Time Chunking cases, a JSON list of {prev_chunk (an array "
                                                  "in --inputs), inference_delay, execution_horizon, schedule, "
                                                  "max_guidance_weight, guidance: lerobot|vjp}; writes "
                                                  "actions_rtc_<i> and actions_normalized_rtc_<i>")
    rn.add_argument("--time", type=int, default=0, metavar="N", help="also time N calls of predict_action_chunk "
                                                                     "(with --rtc, also N of the first case's)")
    rn.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def io_problems(o: dict) -> list[str]:
    """What is wrong with the cameras, state_dim and action_dim of make-checkpoint options (also GR00T's)."""
    problems = []
    cams = o["cameras"]
    if not cams or len(set(cams)) != len(cams) or not all(c.replace("_", "").isalnum() for c in cams):
        problems.append("cameras must be one or more distinct names of letters, digits and _")
    if not 0 < o["state_dim"] <= o["max_state_dim"]:
        problems.append("state_dim must be in 1..max_state_dim")
    if not 0 < o["action_dim"] <= o["max_action_dim"]:
        problems.append("action_dim must be in 1..max_action_dim")
    return problems


def shape_problems(o: dict) -> list[str]:
    """What is wrong in the options every policy's make-checkpoint shares (heads, cameras, state and action sizes,
    steps, normalisation modes); each runner adds its own checks."""
    problems = []
    if o["vision_width"] % o["vision_heads"]:
        problems.append("vision_width must be a multiple of vision_heads")
    if o["num_heads"] % o["num_kv_heads"]:
        problems.append("num_heads must be a multiple of num_kv_heads")
    problems += io_problems(o)
    if not 0 < o["n_action_steps"] <= o["chunk_size"]:
        problems.append("n_action_steps must be in 1..chunk_size")
    for key in ("state_norm", "action_norm"):
        if o[key] not in NORM_MODES:
            problems.append(f"{key} must be one of {', '.join(NORM_MODES)}")
    return problems


def validate_options(o: dict) -> None:
    problems = shape_problems(o)
    if o["policy"] not in POLICIES:
        problems.append(f"policy must be one of {', '.join(POLICIES)}")
    if o["tokenizer_max_length"] is not None and o["tokenizer_max_length"] < 1:
        problems.append("tokenizer_max_length must be positive")
    if o["image_size"] % PATCH_SIZE:
        problems.append(f"image_size must be a multiple of {PATCH_SIZE}")
    if o["dtype"] not in ("float32", "bfloat16"):
        problems.append("dtype must be float32 or bfloat16")
    if (o["relative_actions"] or o["action_names"]) and not lerobot_06():
        problems.append("relative_actions and action_names need LeRobot 0.5 or later")
    if o["action_names"] is not None and len(o["action_names"]) != o["action_dim"]:
        problems.append("action_names must name action_dim actions")
    if problems:
        raise SystemExit("; ".join(problems))


def gemma_dims(o: dict, variant: str, width: int, mlp_dim: int) -> dict:
    """A tiny_dims.json Gemma entry ("vlm" or "expert") of the options ``o``."""
    return {
        "variant": variant,
        "width": width,
        "depth": o["depth"],  # the VLM and the expert share attention layer by layer
        "mlp_dim": mlp_dim,
        "num_heads": o["num_heads"],
        "num_kv_heads": o["num_kv_heads"],
        "head_dim": o["head_dim"],
    }


def vision_dims(o: dict) -> dict:
    """The tiny_dims.json "vision" entry of the options ``o``."""
    return {
        "hidden_size": o["vision_width"],
        "num_hidden_layers": o["vision_depth"],
        "num_attention_heads": o["vision_heads"],
        "intermediate_size": o["vision_mlp_dim"],
        "patch_size": PATCH_SIZE,
        "image_size": o["image_size"],
        "num_image_tokens": (o["image_size"] // PATCH_SIZE) ** 2,
    }


def dims_from_options(o: dict) -> dict:
    dims = {
        "format": 1,
        "seed": o["seed"],
        "vocab_size": VOCAB_SIZE,
        "vlm": gemma_dims(o, "gemma_2b", o["vlm_width"], o["vlm_mlp_dim"]),
        "expert": gemma_dims(o, "gemma_300m", o["expert_width"], o["expert_mlp_dim"]),
        "vision": vision_dims(o),
    }
    if o["policy"] != "pi0":
        dims["policy"] = o["policy"]
    return dims


def pi0_weight_value(module, module_name: str, param_name: str, param, noise):
    """The random value of one π0/π0.5 parameter given its standard normal draw (see randomize_weights)."""
    from torch import nn
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    if isinstance(module, GemmaRMSNorm) or type(module).__name__ == "PiGemmaRMSNorm":  # LeRobot 0.6: its own class
        return 0.3 * noise
    if isinstance(module, nn.LayerNorm):
        return 1.0 + 0.3 * noise if param_name == "weight" else 0.1 * noise
    if param_name == "bias":
        return 0.1 * noise
    if isinstance(module, nn.Embedding) and "position_embedding" in module_name:
        return 0.5 * noise
    if isinstance(module, nn.Embedding):
        return noise / param.shape[1] ** 0.5  # π0 multiplies language embeddings by sqrt(width)
    return noise / (param[0].numel() ** 0.5)  # Linear and Conv2d weights: [out, in, ...]


def randomize_weights(policy, seed: int, rule=pi0_weight_value) -> None:
    """Overwrite every parameter with seeded random values that keep activations of order one.

    Each tensor draws from its own generator, seeded from the seed and the parameter's name, so the weights do not
    depend on module construction order or on the transformers build; ``rule(module, module_name, param_name,
    param, noise)`` turns the standard normal draw into the value. π0's rule: norm weights are random too (Gemma's
    RMSNorm scales by (1 + w), which zero weights would not exercise); biases are nonzero. π0.5's adaptive norms
    (their ``dense``, which LeRobot initialises to zero) and its time MLP are Linear layers and get the same draw as
    the others, std 1/sqrt(fan_in) and biases of std 0.1: scale, shift and gate come out of order 0.1, enough for
    the time condition to matter without swamping the activations.
    """
    import torch

    done = set()
    for module_name, module in policy.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in done:  # PaliGemma ties lm_head to embed_tokens
                continue
            done.add(id(param))
            name = f"{module_name}.{param_name}"
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            value = rule(module, module_name, param_name, param, noise)
            with torch.no_grad():
                param.copy_(value.to(param.dtype))


def make_stats(rng: np.random.Generator, dim: int, count: int = 20000) -> dict:
    """Plausible dataset statistics for one feature: min < q01 < q10 < q50 < q90 < q99 < max, std > 0."""
    center = rng.normal(0.0, 0.5, dim)
    spread = rng.uniform(0.2, 1.5, dim)

    def side(lo, hi):
        return spread * rng.uniform(lo, hi, dim)

    stats = {
        "mean": center + 0.05 * spread * rng.normal(size=dim),
        "std": spread,
        "min": center - side(2.6, 3.5),
        "max": center + side(2.6, 3.5),
        "q01": center - side(2.0, 2.4),
        "q99": center + side(2.0, 2.4),
        "q10": center - side(1.1, 1.4),
        "q90": center + side(1.1, 1.4),
        "q50": center + 0.05 * spread * rng.normal(size=dim),
    }
    stats = {k: v.astype(np.float32) for k, v in stats.items()}
    stats["count"] = np.array([count], dtype=np.int64)
    return stats


@contextlib.contextmanager
def tokenizer_not_loaded():
    """Keep LeRobot's TokenizerProcessorStep from fetching the PaliGemma tokenizer from the Hub.

    make_pi0_pre_post_processors builds TokenizerProcessorStep(tokenizer_name="google/paligemma-3b-pt-224"), which
    loads the tokenizer when it is constructed. Saving the pipeline only records the name, so the step gets a
    tokenizer that refuses to be used, and the saved policy_preprocessor.json is the one LeRobot writes.
    """
    from lerobot.processor import tokenizer_processor

    class _NoTokenizer:
        def __init__(self, name):
            self.name = name

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"tokenizer {self.name!r} is not available offline")

    class _Offline:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            return _NoTokenizer(name)

    saved = tokenizer_processor.AutoTokenizer
    tokenizer_processor.AutoTokenizer = _Offline
    try:
        yield
    finally:
        tokenizer_processor.AutoTokenizer = saved


def make_checkpoint(args) -> dict:
    """Build the policy of --policy at the small sizes, randomise it and save it with LeRobot's own save_pretrained,
    beside its pre/post processors (with the dataset statistics every normalisation mode needs) and tiny_dims.json.
    """
    import torch

    opts = checkpoint_options(args)
    semantics = prepare_lerobot(args.transformers_shim)

    _, policy_cls, config_cls, make_processors = policy_modules(opts["policy"])
    dims = dims_from_options(opts)
    apply_model_dims(dims)
    size = opts["image_size"]
    extra = {}
    if opts["tokenizer_max_length"] is not None:
        extra["tokenizer_max_length"] = opts["tokenizer_max_length"]
    if opts["relative_actions"]:
        extra["use_relative_actions"] = True
    if opts["action_names"]:
        extra["action_feature_names"] = list(opts["action_names"])
    config = config_cls(
        paligemma_variant=dims["vlm"]["variant"],
        action_expert_variant=dims["expert"]["variant"],
        dtype=opts["dtype"],
        chunk_size=opts["chunk_size"],
        n_action_steps=opts["n_action_steps"],
        max_state_dim=opts["max_state_dim"],
        max_action_dim=opts["max_action_dim"],
        num_inference_steps=opts["num_inference_steps"],
        image_resolution=(size, size),
        **feature_config(opts),
        **extra,
    )
    torch.manual_seed(opts["seed"])
    policy = policy_cls(config)
    randomize_weights(policy, opts["seed"])
    with tokenizer_not_loaded():
        preprocessor, postprocessor = make_processors(config, dataset_stats=dataset_stats(opts))

    out = Path(args.out)
    save_checkpoint(out, policy, preprocessor, postprocessor, dims)
    result = {"checkpoint": str(out), "semantics": semantics, "files": sorted(p.name for p in out.iterdir())}
    if opts["policy"] != "pi0":
        result["policy"] = opts["policy"]
    return result


# --------------------------------------------------------------------------------------------------------------
# run


class PretokenizedPrompt:
    """A tokenizer for TokenizerProcessorStep that returns ids tokenised beforehand.

    The PaliGemma tokenizer is on the Hub and the project tokenises prompts itself, so the run inputs carry the
    ids; this object pads them the way LeRobot's call to the tokenizer asks for (π0: padding="max_length", right
    side, pad id 0, truncation), which is the only thing LeRobot does with the tokenizer's output. With
    padding="longest" (SmolVLA's default) every prompt of the batch is the given ids, so nothing is padded.
    """

    def __init__(self, ids: np.ndarray, pad_id: int = PAD_TOKEN_ID):
        self.ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        self.pad_id = pad_id
        self.texts = None  # the prompts LeRobot asked to tokenise last (π0.5's carry the state)

    def __call__(self, text, max_length, truncation=True, padding="max_length", padding_side="right", **_):
        import torch

        texts = [text] if isinstance(text, str) else list(text)
        self.texts = texts
        ids = self.ids[:max_length] if truncation else self.ids
        if padding == "longest":
            max_length = len(ids)
        if padding not in ("max_length", "longest") or len(ids) > max_length:
            raise ValueError(f"cannot pad the given ids as padding={padding!r}, max_length={max_length} asks")
        pad = [self.pad_id] * (max_length - len(ids))
        mask = [1] * len(ids)
        if padding_side == "right":
            row, row_mask = ids + pad, mask + [0] * len(pad)
        else:
            row, row_mask = pad + ids, [0] * len(pad) + mask
        return {
            "input_ids": torch.tensor([row] * len(texts), dtype=torch.long),
            "attention_mask": torch.tensor([row_mask] * len(texts), dtype=torch.long),
        }


def load_reference(checkpoint: Path, lang_tokens: np.ndarray, policy_type: str = "pi0"):
    """The policy and its pre/post processors, loaded by LeRobot from the checkpoint directory, and the tokenizer
    stand-in.

    The preprocessor is rebuilt from policy_preprocessor.json with its saved normaliser state; the tokenizer step
    stays in place but is handed PretokenizedPrompt instead of loading the PaliGemma tokenizer.
    """
    import torch
    from safetensors.torch import load_file

    dims = read_dims(checkpoint)
    if dims is not None:
        if dims.get("policy", "pi0") != policy_type:
            raise ValueError(f"{checkpoint}: config.json says {policy_type}, {DIMS_FILE} {dims.get('policy', 'pi0')}")
        apply_model_dims(dims)
    policy = policy_modules(policy_type)[1].from_pretrained(checkpoint)
    policy.eval()
    verify_weights(policy, load_file(checkpoint / "model.safetensors"))

    tokenizer = PretokenizedPrompt(lang_tokens)
    preprocessor, postprocessor = load_processors(checkpoint, tokenizer)
    torch.set_grad_enabled(False)
    return policy, preprocessor, postprocessor, tokenizer


def load_processors(checkpoint: Path, tokenizer):
    """The checkpoint's pre and post processors as LeRobot rebuilds them from policy_preprocessor.json and
    policy_postprocessor.json (with their saved normaliser state), the tokenizer step handed ``tokenizer``."""
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        batch_to_transition,
        policy_action_to_transition,
        transition_to_batch,
        transition_to_policy_action,
    )

    steps = json.loads((checkpoint / "policy_preprocessor.json").read_text())["steps"]
    overrides = {}
    if any(step.get("registry_name") == TOKENIZER_STEP for step in steps):
        overrides[TOKENIZER_STEP] = {"tokenizer": tokenizer}
    preprocessor = PolicyProcessorPipeline.from_pretrained(
        checkpoint,
        config_filename="policy_preprocessor.json",
        overrides=overrides,
        to_transition=batch_to_transition,
        to_output=transition_to_batch,
    )
    postprocessor = PolicyProcessorPipeline.from_pretrained(
        checkpoint,
        config_filename="policy_postprocessor.json",
        to_transition=policy_action_to_transition,
        to_output=transition_to_policy_action,
    )
    # LeRobot 0.5+: the absolute-actions step reads the state the relative-actions step cached, a link that
    # loading does not restore (LeRobot's own loader makes it again, as here)
    relative = [s for s in preprocessor.steps if type(s).__name__ == "RelativeActionsProcessorStep"]
    for step in postprocessor.steps:
        if type(step).__name__ == "AbsoluteActionsProcessorStep" and relative:
            step.relative_step = relative[0]
    return preprocessor, postprocessor


def verify_weights(policy, saved: dict) -> None:
    """Fail unless every saved tensor is in the policy unchanged.

    PI0Policy.from_pretrained (and PI05Policy's) loads with strict=True and only prints a warning when that raises,
    which it does for LeRobot 0.4's own checkpoints: save_model drops embed_tokens, the tied twin of lm_head. The
    tensors are still copied, but a silent partial load must not pass for a reference, so the result is checked
    here. (LeRobot 0.6's PaliGemma does not tie them: both are saved, each loads as itself.)
    """
    import torch

    state = policy.state_dict()
    wrong = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v.to(state[k].dtype))]
    if wrong:
        raise RuntimeError(f"{len(wrong)} saved tensors did not load, e.g. {wrong[:3]}")
    pali = policy.model.paligemma_with_expert.paligemma
    embed = pali.model.language_model.embed_tokens.weight
    if not any(k.endswith("embed_tokens.weight") and "paligemma." in k for k in saved) and not (
            pali.lm_head.weight.data_ptr() == embed.data_ptr() or torch.equal(pali.lm_head.weight, embed)):
        # LeRobot 0.4 ties the two; 0.5+ copies a lone lm_head into embed_tokens on load
        raise RuntimeError("the saved lm_head did not become the embedding table")


def read_inputs(path: Path, config, rtc_cases: list | None = None) -> dict:
    data = np.load(path)
    images = {}
    for key in config.image_features:
        if key in data.files:
            img = data[key]
            if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
                raise ValueError(f"{key}: expected uint8 HxWx3, got {img.dtype} {img.shape}")
            images[key] = img
    if not images:
        raise ValueError(f"{path} has none of the cameras {list(config.image_features)}")
    leftovers = {case["prev_chunk"] for case in rtc_cases or []}
    missing = sorted(leftovers - set(data.files))
    if missing:
        raise ValueError(f"{path} lacks the RTC leftovers {missing}")
    extra = sorted(set(data.files) - set(images) - leftovers - {"lang_tokens", "state", "noise"})
    if extra:
        raise ValueError(f"{path}: unexpected arrays {extra}")
    state = data["state"].astype(np.float32).reshape(-1)
    if state.shape[0] != config.input_features["observation.state"].shape[0]:
        raise ValueError(f"state has {state.shape[0]} values, the checkpoint expects "
                         f"{config.input_features['observation.state'].shape[0]}")
    noise = data["noise"].astype(np.float32)
    if noise.shape != (config.chunk_size, config.max_action_dim):
        raise ValueError(f"noise must be [{config.chunk_size}, {config.max_action_dim}], got {list(noise.shape)}")
    prev = {}
    for key in leftovers:
        prev[key] = data[key].astype(np.float32)
        if prev[key].ndim != 2 or prev[key].shape[0] > config.chunk_size or prev[key].shape[1] > config.max_action_dim:
            raise ValueError(f"{key}: an RTC leftover is [steps <= {config.chunk_size}, dims <= "
                             f"{config.max_action_dim}], got {list(prev[key].shape)}")
    return {"images": images, "lang_tokens": data["lang_tokens"].astype(np.int64), "state": state, "noise": noise,
            "prev": prev}


RTC_KEYS = {"prev_chunk", "inference_delay", "execution_horizon", "schedule", "max_guidance_weight"}
RTC_GUIDANCE = ("lerobot", "vjp")


def read_rtc_cases(path: str | None) -> list:
    """The --rtc file: a JSON list of {prev_chunk: name of a leftover array in the inputs .npz (normalised model
    actions [steps, dims]), inference_delay, execution_horizon, schedule: ZEROS|ONES|LINEAR|EXP,
    max_guidance_weight, and optionally guidance: lerobot (default) | vjp}."""
    if not path:
        return []
    cases = json.loads(Path(path).read_text())
    if not isinstance(cases, list) or not all(
            isinstance(c, dict) and RTC_KEYS <= set(c) <= RTC_KEYS | {"guidance"} for c in cases):
        raise ValueError(f"{path}: expected a JSON list of objects with the keys {sorted(RTC_KEYS)} and "
                         f"optionally guidance")
    for c in cases:
        if c.setdefault("guidance", "lerobot") not in RTC_GUIDANCE:
            raise ValueError(f"{path}: guidance {c['guidance']!r} is not one of {RTC_GUIDANCE}")
    return cases


def through_the_model(processor) -> None:
    """Make ``processor.denoise_step`` take the vector-Jacobian product through the model (the paper's
    Algorithm 1) instead of LeRobot's weighted error: the denoiser marks its input as requiring gradients
    before it evaluates the velocity, so the autograd call in denoise_step differentiates x_t - t * v(x_t)
    through v; the rest of LeRobot's step (padding, prefix weights, guidance weight) is unchanged."""
    denoise_step = processor.denoise_step

    def guided(x_t, prev_chunk_left_over, inference_delay, time, original_denoise_step_partial,
               execution_horizon=None):
        def velocity(x):
            x.requires_grad_(True)
            return original_denoise_step_partial(x)

        return denoise_step(x_t, prev_chunk_left_over, inference_delay, time, velocity, execution_horizon)

    processor.denoise_step = guided


def rtc_chunk(policy, batch, noise, prev, case: dict):
    """LeRobot's predict_action_chunk with Real-Time Chunking enabled in the policy's config (the guidance's
    autograd call needs grad mode, so this runs under no_grad, not inference_mode)."""
    import torch
    from lerobot.configs.types import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    policy.config.rtc_config = RTCConfig(
        enabled=True,
        prefix_attention_schedule=RTCAttentionSchedule(case["schedule"]),
        max_guidance_weight=float(case["max_guidance_weight"]),
        execution_horizon=int(case["execution_horizon"]),
    )
    policy.init_rtc_processor()
    if not (policy.model._rtc_enabled() and policy.model.rtc_processor is policy.rtc_processor):
        raise RuntimeError(f"RTC did not reach the {policy.name} model")
    if case["guidance"] == "vjp":
        through_the_model(policy.rtc_processor)
    try:
        with torch.no_grad():
            return policy.predict_action_chunk(batch, noise=noise.clone(), prev_chunk_left_over=torch.from_numpy(prev),
                                               inference_delay=int(case["inference_delay"]))
    finally:
        policy.config.rtc_config = None
        policy.init_rtc_processor()


def run(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    semantics = prepare_lerobot(args.transformers_shim)
    importlib.import_module("lerobot.policies")  # registers the policies' config classes with PreTrainedConfig
    from lerobot.configs.policies import PreTrainedConfig

    checkpoint = Path(args.checkpoint)
    config = PreTrainedConfig.from_pretrained(checkpoint)
    if config.type not in POLICIES:
        raise SystemExit(f"{checkpoint} holds a {config.type!r} policy, not one of {', '.join(POLICIES)}")
    rtc_cases = read_rtc_cases(getattr(args, "rtc", None))
    inputs = read_inputs(Path(args.inputs), config, rtc_cases)
    policy, preprocessor, postprocessor, tokenizer = load_reference(checkpoint, inputs["lang_tokens"], config.type)
    # π0 tokenises the task alone (the given ids stand for it); π0.5's preprocessor writes the state into it.
    task = getattr(args, "task", DEFAULT_TASK) if config.type == "pi05" else ""
    batch, normalized, actions, guided, timing = compute_chunks(policy, preprocessor, postprocessor, inputs,
                                                                rtc_cases, task, args.time)

    result = {"semantics": semantics, "actions_shape": list(actions.shape[1:])}
    if config.type == "pi05":
        result.update(policy="pi05", **pi05_prompt(batch, tokenizer, preprocessor))
    if args.out:
        write_outputs(args.out, batch, normalized, actions, guided)
        result["out"] = str(args.out)
    if timing:
        result.update(timing)
    return result


def compute_chunks(policy, preprocessor, postprocessor, inputs: dict, rtc_cases: list, task: str, time_calls: int):
    """The preprocessed batch, LeRobot's predict_action_chunk on it (normalised) and the postprocessor's actions,
    the (normalised, actions) pair of each RTC case and, when ``time_calls``, the timing of that many calls (and of
    the first RTC case's guided chunk); ``inputs`` as read_inputs returns them."""
    import torch
    from lerobot.policies.utils import prepare_observation_for_inference

    # What lerobot-record / predict_action do with a robot observation: uint8 HWC -> float [0,1] CHW with a batch
    # dimension, then the preprocessor (batching, the normaliser, for π0.5 the state prompt, the tokenizer step).
    observation = {key: img.copy() for key, img in inputs["images"].items()}
    observation["observation.state"] = inputs["state"].copy()
    noise = torch.from_numpy(inputs["noise"])[None]
    # RTC's guidance takes an autograd gradient, which inference tensors (inference_mode) do not allow.
    with torch.no_grad() if rtc_cases else torch.inference_mode():
        observation = prepare_observation_for_inference(observation, torch.device("cpu"), task=task, robot_type="")
        batch = preprocessor(observation)
        normalized = policy.predict_action_chunk(batch, noise=noise.clone())
        actions = postprocessor(normalized.clone())
        guided = []
        for case in rtc_cases:
            chunk = rtc_chunk(policy, batch, noise, inputs["prev"][case["prev_chunk"]], case)
            guided.append((chunk, postprocessor(chunk.clone())))

        timing = None
        if time_calls:
            times = []
            for _ in range(time_calls):
                start = time.perf_counter()
                policy.predict_action_chunk(batch, noise=noise.clone())
                times.append((time.perf_counter() - start) * 1e3)
            timing = {
                "calls": time_calls,
                "threads": torch.get_num_threads(),
                "median_ms": statistics.median(times),
                "min_ms": min(times),
                "max_ms": max(times),
            }
            if rtc_cases:  # the first case's guided chunk, timed the same way
                case = rtc_cases[0]
                times = []
                for _ in range(time_calls):
                    start = time.perf_counter()
                    rtc_chunk(policy, batch, noise, inputs["prev"][case["prev_chunk"]], case)
                    times.append((time.perf_counter() - start) * 1e3)
                timing.update(rtc_median_ms=statistics.median(times), rtc_min_ms=min(times), rtc_max_ms=max(times))
    return batch, normalized, actions, guided, timing


def write_outputs(path, batch: dict, normalized, actions, guided: list) -> None:
    """run's --out .npz: the first batch row of compute_chunks' results."""
    np.savez(
        path,
        actions=actions[0].numpy().astype(np.float32),
        actions_normalized=normalized[0].numpy().astype(np.float32),
        state_normalized=batch["observation.state"][0].numpy().astype(np.float32),
        lang_tokens=batch["observation.language.tokens"][0].numpy(),
        lang_mask=batch["observation.language.attention_mask"][0].numpy(),
        **{f"actions_rtc_{i}": a[0].numpy().astype(np.float32) for i, (_, a) in enumerate(guided)},
        **{f"actions_normalized_rtc_{i}": n[0].numpy().astype(np.float32) for i, (n, _) in enumerate(guided)},
    )


def pi05_prompt(batch: dict, tokenizer: PretokenizedPrompt, preprocessor) -> dict:
    """What π0.5's preprocessor made of the raw state and the task: the prompt its tokenizer step was asked to
    tokenise (built by LeRobot's NormalizerProcessorStep and Pi05PrepareStateTokenizerProcessorStep from the
    checkpoint's statistics) and the normalised state padded as that prompt discretises it.

    The padding is the loaded Pi05PrepareStateTokenizerProcessorStep's max_state_dim: LeRobot saves that step
    without its configuration, so a reloaded checkpoint pads to 32 whatever config.json's max_state_dim says.
    """
    from lerobot.policies.pi05.modeling_pi05 import pad_vector
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep

    prompts = tokenizer.texts
    if not prompts or len(prompts) != 1 or batch.get("task") != prompts:
        raise RuntimeError(f"π0.5's tokenizer step was not handed the state prompt (got {prompts!r})")
    steps = [s for s in preprocessor.steps if isinstance(s, Pi05PrepareStateTokenizerProcessorStep)]
    if len(steps) != 1:
        raise RuntimeError("the π0.5 preprocessor has no state prompt step")
    state = pad_vector(batch["observation.state"], steps[0].max_state_dim)[0]
    return {"prompt": prompts[0], "state_normalized": [float(v) for v in state.numpy()]}


# --------------------------------------------------------------------------------------------------------------
# check


def check(args) -> dict:
    """Import LeRobot's π0 and π0.5 here and run a minute random model of each once, end to end."""
    import tempfile

    import lerobot
    import torch
    import transformers

    semantics = prepare_lerobot(args.transformers_shim)
    minute = {
        "vlm_width": 16, "depth": 1, "vlm_mlp_dim": 32, "expert_width": 16, "expert_mlp_dim": 32, "head_dim": 8,
        "vision_width": 16, "vision_depth": 1, "vision_heads": 2, "vision_mlp_dim": 32, "image_size": 28,
        "chunk_size": 4, "num_inference_steps": 2, "state_dim": 3, "action_dim": 2,
    }
    shim = args.transformers_shim
    for policy in POLICIES:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            options = {**minute, "policy": policy}
            if policy == "pi05":
                options["tokenizer_max_length"] = 32
            make_checkpoint(argparse.Namespace(out=tmp, options=json.dumps(options), transformers_shim=shim))
            rng = np.random.default_rng(0)
            np.savez(
                tmp / "in.npz",
                **{"observation.images.base": rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)},
                lang_tokens=np.array([2, 100, 200], dtype=np.int64),
                state=rng.normal(size=3).astype(np.float32),
                noise=rng.normal(size=(4, 32)).astype(np.float32),
            )
            result = run(argparse.Namespace(checkpoint=tmp, inputs=tmp / "in.npz", out=tmp / "out.npz", time=0,
                                            threads=0, transformers_shim=shim, task=DEFAULT_TASK))
            actions = np.load(tmp / "out.npz")["actions"]
        if actions.shape != (4, 2) or not np.isfinite(actions).all():
            raise SystemExit(f"{policy} reference check failed: actions {actions.shape}")
        if policy == "pi05" and not result["prompt"].startswith(f"Task: {DEFAULT_TASK}, State: "):
            raise SystemExit(f"pi05 reference check failed: prompt {result['prompt']!r}")
    return {
        "pi0_reference": "ok",
        "pi05_reference": "ok",
        "semantics": semantics,
        "lerobot": lerobot.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--transformers-shim",
        choices=("auto", "on", "off"),
        default="auto",
        help="patch the branch's π0 semantics into stock transformers (auto: unless the branch is installed)",
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("check", parents=[common], help="smoke test of the environment")

    mk = sub.add_parser("make-checkpoint", parents=[common],
                        help="save a small random π0 or π0.5 as a LeRobot checkpoint")
    mk.add_argument("--out", required=True, help="checkpoint directory to write")
    mk.add_argument("--options", help="JSON object of the options below (underscored names), or @file.json")
    flags = {
        "policy": str, "seed": int, "vlm_width": int, "depth": int, "vlm_mlp_dim": int, "expert_width": int, "expert_mlp_dim": int,
        "num_heads": int, "num_kv_heads": int, "head_dim": int, "vision_width": int, "vision_depth": int,
        "vision_heads": int, "vision_mlp_dim": int, "image_size": int, "cameras": str, "state_dim": int,
        "action_dim": int, "max_state_dim": int, "max_action_dim": int, "chunk_size": int, "n_action_steps": int,
        "num_inference_steps": int, "tokenizer_max_length": int, "state_norm": str, "action_norm": str,
        "dtype": str, "relative_actions": flag, "action_names": str,
    }
    policy_norms = ", ".join(f"{p} {mode}" for p, mode in POLICY_NORMS.items())
    notes = {
        "policy": "one of " + ", ".join(POLICIES) + " (LeRobot's lerobot.policies.<policy>)",
        "cameras": "comma-separated; features observation.images.<name>",
        "n_action_steps": "default chunk_size",
        "tokenizer_max_length": "default the policy's (pi0 48, pi05 200)",
        "state_norm": f"one of {', '.join(NORM_MODES)}; default {policy_norms}",
        "action_norm": f"one of {', '.join(NORM_MODES)}; default {policy_norms}",
        "dtype": "float32 or bfloat16",
        "relative_actions": "true: use_relative_actions (LeRobot 0.5+)",
        "action_names": "comma-separated: action_feature_names (LeRobot 0.5+)",
    }
    add_option_flags(mk, CHECKPOINT_DEFAULTS, flags, notes)

    rn = sub.add_parser("run", parents=[common], help="compute one action chunk with LeRobot's π0 or π0.5")
    rn.add_argument("--checkpoint", required=True, help="LeRobot π0 or π0.5 checkpoint directory")
    rn.add_argument("--inputs", required=True, help=".npz: observation.images.<cam> uint8 HxWx3, lang_tokens int64 "
                                                    "[n], state float32 [state dim], noise float32 [chunk, 32]")
    rn.add_argument("--task", default=DEFAULT_TASK, help="π0.5: the task its prompt states, reported with the "
                                                         "state as the result's \"prompt\" (default %(default)r)")
    add_run_flags(rn)

    args = parser.parse_args(argv)
    print_result({"check": check, "make-checkpoint": make_checkpoint, "run": run}[args.command], args)


def flag(text: str) -> bool:
    """A true/false option value."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def add_option_flags(parser, defaults: dict, flags: dict, notes: dict) -> None:
    """One --name flag per entry of ``flags`` (name: type), its help the default and the note."""
    for name, kind in flags.items():
        default = defaults[name]
        shown = ",".join(default) if isinstance(default, list) else default
        text = f"default {shown}" if default is not None else ""
        text = "; ".join(t for t in (text, notes.get(name, "")) if t)
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)


def print_result(command, args) -> None:
    """Run ``command(args)`` with stdout sent to stderr and print its result as one JSON line on stdout."""
    # LeRobot prints progress to stdout; the script's stdout carries only its result, one JSON line.
    results = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        result = command(args)
    results.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
