"""Shape-polymorphic graph modules: one per graph *kind*, for engines with one optimization profile per
bucket (TensorRT, see ``synflux_ros.backends.tensorrt.plan``).

They wrap the same :class:`~synflux_ros.graphkit.torch_models.decoder.CausalLM` /
:class:`~synflux_ros.graphkit.torch_models.action_expert.ActionExpert` objects as the static per-bucket
modules (so the weights are identical) and compute the same thing, with the bucket sizes taken from the
input shapes instead of Python ints, so a trace exports them as dynamic dims:

* ``T`` = ``inputs_embeds.shape[1]`` / ``input_ids.shape[1]``: the number of new rows;
* ``D`` = ``attention_span.shape[0]``: the number of cache positions attended. ``attention_span`` is a
  shape-only input (float32 ``[D]``); its values are never read.

::

    ProfiledEmbed(lm)(input_ids [1,T])                               == embed_<T>
    ProfiledLLM(lm, kv_dtype)(embeds [1,T,H], num_tokens, cache_position, past_kv, span [S] (, state)) == prefill_<T>
    ProfiledLLM(lm, kv_dtype)(embed(ids) [1,1,H], 1, cache_position, past_kv, span [d])       == decode_<d>
    ProfiledActionExpert(expert)(noisy_actions, time_embedding, prefix_len, past_kv, span [d] (, state))
                                                                                              == action_expert_<d>
    ProfiledActionExpertVJP(expert)(..., span [d] (, state), target, weights, flow_time)  == action_expert_vjp_<d>

``past_kv`` is taken the way the static modules take it (the contract tensor or its per-layer views).
"""
from __future__ import annotations

import torch
from torch import nn

from ...graphkit.torch_models.action_expert import ActionExpert
from ...graphkit.torch_models.action_expert_vjp import ActionExpertVJPGraph
from ...graphkit.torch_models.decoder import CausalLM, state_row, torch_dtype


def _arange(n) -> torch.Tensor:
    """0 .. n-1 (int64); ``n`` an int or a traced size, which exports a Range over a shape value."""
    return torch.arange(n, dtype=torch.int64)


class ProfiledEmbed(nn.Module):
    """embed: input_ids [1, T] -> inputs_embeds [1, T, H] (``EmbedGraph`` at any T)."""

    def __init__(self, lm: CausalLM):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return (self.lm.embed(input_ids[0]).unsqueeze(0),)


class ProfiledLLM(nn.Module):
    """llm: inputs_embeds [1, T, H], num_tokens [1], cache_position [1], past_kv, attention_span [D]
    -> logits [1, V], new_kv [L, 2, KV, T, Dh].

    Rows i < num_tokens at positions cache_position + i attend to the cache positions j < D that are
    below cache_position and to new rows i' <= i (every valid new row with ``llm.prefill_attention:
    bidirectional``); logits of row num_tokens - 1; new_kv rows >= num_tokens are zero. (T = p, D = S) is ``prefill_<p>``; (T = 1, D = d, num_tokens = 1) on the
    embedded token is ``decode_<d>``. With ``logits=False`` (a flow-matching VLA) it returns new_kv alone."""

    def __init__(self, lm: CausalLM, kv_dtype: str, logits: bool = True, state_proj: nn.Module | None = None,
                 expert: nn.Module | None = None):
        super().__init__()
        self.lm = lm
        self.kv_dtype = torch_dtype(kv_dtype)
        self.bidirectional = lm.llm.prefill_attention == "bidirectional"
        self.logits = logits
        self.state_proj = state_proj
        self.expert = expert  # SmolVLA's cross-attention layers' projections of the prefix (PrefillGraph's)

    def forward(self, inputs_embeds, num_tokens, cache_position, past_kv, attention_span, state=None):
        t, d = inputs_embeds.shape[1], attention_span.shape[0]
        rows = _arange(t)
        past_ok = (_arange(d)[None, :] < cache_position).expand(t, d)
        x = inputs_embeds[0]
        if self.state_proj is not None:  # SmolVLA: the prefix's last row is the robot state's
            x, new_ok = state_row(x, rows, num_tokens, self.state_proj, state)
        elif self.bidirectional:
            new_ok = (rows[None, :] < num_tokens).expand(t, t)
        else:
            new_ok = rows[None, :] <= rows[:, None]
        allowed = torch.cat((past_ok, new_ok), dim=1)
        h, new_kv = self.lm.run(x, cache_position + rows, past_kv, allowed, self.kv_dtype, span=d)
        if self.expert is not None:
            new_kv = self.expert.project_prefix(new_kv)
        return self.lm.prefill_outputs(h, new_kv, rows, num_tokens, self.logits)


class ProfiledActionExpert(nn.Module):
    """action_expert: noisy_actions [1, h, a], time_embedding [1], prefix_len [1], past_kv, attention_span [D]
    -> velocity [1, h, a] (``ActionExpertGraph`` with bucket D)."""

    def __init__(self, expert: ActionExpert):
        super().__init__()
        self.expert = expert

    def forward(self, noisy_actions, time_embedding, prefix_len, past_kv, attention_span, state=None):
        return (self.expert.velocity(noisy_actions, time_embedding, prefix_len, past_kv, attention_span.shape[0],
                                     state),)


class ProfiledActionExpertVJP(nn.Module):
    """action_expert_vjp: the inputs of :class:`ProfiledActionExpert`, then target [1, h, a], weights [1, h, 1],
    flow_time [1] -> velocity, correction [1, h, a] (``ActionExpertVJPGraph`` with bucket D)."""

    def __init__(self, expert: ActionExpert):
        super().__init__()
        self.graph = ActionExpertVJPGraph(expert, 0)

    def forward(self, noisy_actions, time_embedding, prefix_len, past_kv, attention_span, *rest):
        state, (target, weights, flow_time) = (rest[0], rest[1:]) if len(rest) == 4 else (None, rest)
        return self.graph.guided(noisy_actions, time_embedding, prefix_len, past_kv, attention_span.shape[0], state,
                                 target, weights, flow_time)


class FlatViews(nn.Module):
    """``inner`` (which takes ``past_kv`` as per-layer (keys, values) pairs at argument ``at``) as a module
    taking flat inputs: the arguments before ``at``, the 2 L views ``past_kv.<l>.<0|1>`` in memory order,
    then the arguments after it."""

    def __init__(self, inner: nn.Module, at: int, num_layers: int):
        super().__init__()
        self.inner, self.at, self.num_layers = inner, at, num_layers

    def forward(self, *flat):
        n = 2 * self.num_layers
        views = flat[self.at:self.at + n]
        pairs = [(views[2 * i], views[2 * i + 1]) for i in range(self.num_layers)]
        return self.inner(*flat[:self.at], pairs, *flat[self.at + n:])
