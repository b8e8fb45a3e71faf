"""Heads: what turns the backbone's prefix into an output. Action heads (flow matching, OpenVLA action
tokens) share one interface, :class:`ActionHead`; text sampling drives the decode loop of a chat turn."""
from __future__ import annotations

from ...core.config import ModelConfig
from ...core.executor import Executor
from .action_tokens import ActionTokenHead
from .base import ActionHead
from .flow_matching import FlowMatchingHead
from .rtc import RTCGuidance


def action_head(cfg: ModelConfig, executor: Executor, backbone) -> ActionHead:
    """The action head ``action.head_type`` names."""
    if cfg.action.head_type == "flow_matching":
        return FlowMatchingHead(cfg, executor)
    return ActionTokenHead(cfg, backbone)


__all__ = ["ActionHead", "ActionTokenHead", "FlowMatchingHead", "RTCGuidance", "action_head"]
