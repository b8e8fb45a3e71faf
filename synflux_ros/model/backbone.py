"""LLM backbone over static bucket graphs: token embedding, chunked prefill, single-token decode.

Prefill of ``n`` new tokens at cache position ``start`` runs the smallest prefill bucket that fits (in
chunks of the largest bucket when ``n`` is larger) and appends the returned KV entries to the slot.
Decode runs the smallest decode bucket whose attention span covers the position.
"""
from __future__ import annotations

import numpy as np

from ..core.executor import DeviceTensor, Executor
from ..core.config import ModelConfig
from ..core.contract import select_bucket


class ContextOverflowError(ValueError):
    """More tokens than the KV cache holds."""


class LLMBackbone:
    """Runs the LLM graphs on a KV slot: embeds tokens, prefills at the smallest bucket that fits (in
    chunks of the largest), decodes one token at the smallest span that covers the position."""

    def __init__(self, cfg: ModelConfig, executor: Executor):
        self.cfg = cfg
        self.ex = executor
        self.prefill_buckets = cfg.llm.prefill_buckets
        self.decode_buckets = cfg.llm.decode_buckets
        self.max_seq = cfg.llm.max_seq_len
        self.hidden = cfg.llm.hidden_dim
        self.mrope = bool(cfg.llm.mrope_section)
        self.bidirectional = cfg.llm.prefill_attention == "bidirectional"
        self.num_deepstack = cfg.vision.num_deepstack if cfg.vision is not None else 0
        self.prefix_state_dim = cfg.prefix_state_dim
        # Token ids are fed in the dtype the graphs declare (llm.token_id_dtype: int64 or int32).
        self.id_dtype = np.dtype(self._id_dtype(executor, cfg))
        # (decode graph, slot) -> (the graph bound to the slot, whether it appends to the slot itself)
        self._decoders: dict[tuple, tuple] = {}

    @staticmethod
    def _id_dtype(executor: Executor, cfg: ModelConfig) -> str:
        graphs = getattr(executor, "graphs", {}) or {}
        for name in (f"embed_{cfg.llm.prefill_buckets[0]}", f"decode_{cfg.llm.decode_buckets[0]}"):
            meta = graphs.get(name)
            if meta is not None:
                return meta.input("input_ids").dtype
        return cfg.llm.token_id_dtype

    def _chunks(self, n: int):
        """(offset, length, bucket) covering n tokens: full largest buckets, then the smallest fit."""
        big = self.prefill_buckets[-1]
        off = 0
        while off < n:
            m = min(big, n - off)
            yield off, m, select_bucket(self.prefill_buckets, m)
            off += m

    def embed(self, ids) -> np.ndarray:
        """Token ids -> embeddings [n, H] through the embed graphs."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        out = np.empty((ids.size, self.hidden), np.float32)
        for off, m, b in self._chunks(ids.size):
            padded = np.zeros((1, b), self.id_dtype)
            padded[0, :m] = ids[off:off + m]
            out[off:off + m] = self.ex.run(f"embed_{b}", {"input_ids": padded})["inputs_embeds"][0, :m]
        return out

    def prefill(self, slot: DeviceTensor, start: int, embeds: np.ndarray, positions: np.ndarray | None = None,
                deepstack: np.ndarray | None = None, state: np.ndarray | None = None) -> np.ndarray | None:
        """Append ``embeds`` [n, H] at cache position ``start``; return the last token's logits [V] (None for
        a model whose prefill computes none, a flow-matching VLA: ``core.contract.reads_logits``).
        Multimodal-rope models take the tokens' rotary ``positions`` [3, n] (default: text positions, the
        cache positions on every axis) and, with DeepStack, the maps ``deepstack`` [K, n, H] (default: zeros,
        as for text tokens). With ``action.state_input: prefix`` the normalised robot ``state`` [state_dim] is
        required: the graph projects it into the last row (whose embedding here is a placeholder)."""
        n = embeds.shape[0]
        if self.prefix_state_dim and (state is None or np.shape(state) != (self.prefix_state_dim,)):
            raise ValueError(f"the prefix ends with the robot state (action.state_input: prefix): a vector of "
                             f"{self.prefix_state_dim} values is needed, got "
                             f"{'none' if state is None else f'shape {np.shape(state)}'}")
        if n < 1:
            raise ValueError("prefill needs at least one token")
        if start + n > self.max_seq:
            raise ContextOverflowError(f"{start} cached + {n} new tokens exceed the context of {self.max_seq}")
        if self.bidirectional and start != 0:
            # The graph attends among the new rows alone (core.contract): the prefix starts the cache.
            raise ValueError(f"a bidirectional prefix (llm.prefill_attention) starts the cache: prefill at "
                             f"position 0, not {start}")
        if self.bidirectional and n > self.prefill_buckets[-1]:
            # The tokens of one call see each other; split over calls, early ones would miss later ones.
            raise ContextOverflowError(f"{n} tokens do not fit the largest prefill bucket "
                                       f"({self.prefill_buckets[-1]}), and a bidirectional prefix "
                                       f"(llm.prefill_attention) must be prefilled in one call")
        if self.mrope and positions is None:
            positions = np.broadcast_to(np.arange(start, start + n, dtype=np.int64), (3, n))
        if self.num_deepstack and deepstack is None:
            deepstack = np.zeros((self.num_deepstack, n, self.hidden), np.float32)
        logits = None
        for off, m, b in self._chunks(n):
            x = np.zeros((1, b, self.hidden), np.float32)
            x[0, :m] = embeds[off:off + m]
            pos = start + off
            feeds = {"inputs_embeds": x, "num_tokens": np.array([m], np.int64),
                     "cache_position": np.array([pos], np.int64), "past_kv": slot}
            if self.mrope:
                # padded rows continue after the last valid one (their keys are discarded)
                p = np.empty((3, b), np.int64)
                p[:, :m] = positions[:, off:off + m]
                p[:, m:] = p[:, m - 1:m] + np.arange(1, b - m + 1)
                feeds["position_ids"] = p
            if self.num_deepstack:
                ds = np.zeros((deepstack.shape[0], b, self.hidden), np.float32)
                ds[:, :m] = deepstack[:, off:off + m]
                feeds["deepstack_embeds"] = ds
            if self.prefix_state_dim:  # one call (a bidirectional prefix): its last row is the state's
                feeds["state"] = np.asarray(state, np.float32).reshape(1, -1)
            out = self.ex.run(f"prefill_{b}", feeds)
            self.ex.write(slot, np.s_[:, :, :, pos:pos + m], out["new_kv"][:, :, :, :m])
            logits = out["logits"][0] if "logits" in out else None
        return logits

    def decode(self, slot: DeviceTensor, pos: int, token: int, rope_pos: int | None = None) -> np.ndarray:
        """Feed one token at cache position ``pos``; return its logits [V]. Multimodal-rope models take the
        token's rotary position ``rope_pos`` too (the same on the t, h and w axes; default ``pos``)."""
        if pos >= self.max_seq:
            raise ContextOverflowError(f"cache position {pos} is beyond the context of {self.max_seq}")
        graph = f"decode_{select_bucket(self.decode_buckets, pos + 1)}"
        feeds = {"input_ids": np.array([[token]], self.id_dtype), "cache_position": np.array([pos], np.int64)}
        if self.mrope:
            feeds["position_ids"] = np.full((3, 1), pos if rope_pos is None else rope_pos, np.int64)
        bound, in_place = self._decoder(graph, slot)
        out = bound.run(feeds)
        if not in_place:
            self.ex.write(slot, np.s_[:, :, :, pos:pos + 1], out["new_kv"])
        return out["logits"][0]

    def _decoder(self, graph: str, slot: DeviceTensor) -> tuple:
        """``graph`` bound to ``slot`` once (a token's call then checks and stages only the ids and the
        position), and whether it appends to the slot itself (then only its logits are read)."""
        key = (graph, slot.name, id(slot.handle))
        entry = self._decoders.get(key)
        if entry is None or not entry[0].valid:
            in_place = self.ex.updates_in_place(graph, "past_kv")
            outputs = ("logits",) if in_place else ("logits", "new_kv")
            entry = self._decoders[key] = (self.ex.bind(graph, {"past_kv": slot}, outputs), in_place)
        return entry
