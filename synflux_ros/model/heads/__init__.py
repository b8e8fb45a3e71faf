"""Heads: what turns the backbone's prefix into an output. Action heads (flow matching, OpenVLA action
tokens, π0-FAST's tokens) share one interface, :class:`ActionHead`; text sampling drives the decode loop of a chat turn."""
from __future__ import annotations

from ...core.config import ModelConfig
from ...core.executor import Executor
from .action_tokens import ActionTokenHead
from .base import ActionHead
from .fast import FastActionHead
from .flow_matching import FlowMatchingHead
from .rtc import RTCGuidance


def action_head(cfg: ModelConfig, executor: Executor, backbone, tokenizer=None) -> ActionHead:
    """The action head ``action.head_type`` (and ``action.token_codec``) names; the fast codec reads the
    backbone's ``tokenizer``."""
    if cfg.action.head_type == "flow_matching":
        return FlowMatchingHead(cfg, executor)
    if cfg.action.token_codec == "fast":
        return FastActionHead(cfg, backbone, tokenizer)
    return ActionTokenHead(cfg, backbone)


__all__ = ["ActionHead", "ActionTokenHead", "FastActionHead", "FlowMatchingHead", "RTCGuidance", "action_head"]
