"""``KVCache``: a ``transformers.Cache`` whose layers hold ragged, policy-compressed KV entries.

Use it like any cache::

    cache = KVCache(model, "snapkv", budget=256)
    model.generate(**inputs, cache=cache, max_new_tokens=32)  # past_key_values= before transformers 5.24

The cache reports the *logical* length (tokens seen) to transformers, so position ids, RoPE and
``generate`` stay right after eviction, and keeps the *physical* entries apart, with their absolute
positions (``kept_positions``), per-head counts (``head_lengths``) and bytes (``nbytes``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from kvsieve.attention.forward import LAYER_TAG
from kvsieve.attention.kernel import AttentionForm
from kvsieve.attention.register import prepare_model
from kvsieve.cache.store import LayerStore
from kvsieve.core.part import PolicyConfigError
from kvsieve.engine.engine import Engine
from kvsieve.engine.layer_inputs import install_layer_input_hooks
from kvsieve.models.architectures import ModelInfo, model_info
from kvsieve.ops.quantize import full_entries_for_bytes
from kvsieve.policies.policy import Policy
from kvsieve.policies.presets import make_policy
from kvsieve.transformers_adapter import Cache, CacheLayerMixin


class KVLayer(CacheLayerMixin):
    """One decoder layer's entries. It only stores: the cache's :class:`~kvsieve.engine.engine.Engine` does the work."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: KVCache, layer_idx: int, sliding_window: int | None):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.left_alone = cache.info.left_alone[layer_idx]
        #: Exact rollback is possible only when nothing is ever evicted.
        self.is_croppable = not cache.policy.evicts
        self.store: LayerStore | None = None
        self.seen = 0
        self.forwards = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._inputs: torch.Tensor | None = None
        #: Same-index layers of other caches sharing this forward (set only by ``prefill_shared``).
        self.followers: list[KVLayer] = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if self.cache.policy.expand_gqa:
            heads = self.cache.info.num_heads
        self.store = LayerStore(batch, heads, dim, key_states.dtype, key_states.device)
        self.cache.engine.init_store(self.store, managed=not self.left_alone)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold the new entries for the kvsieve attention function, which stores them."""
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            raise RuntimeError(
                "KVCache does not support autograd: its stores are updated in place. Run the model under "
                "torch.no_grad() or torch.inference_mode() with a KVCache (use DynamicCache to train through a cache)"
            )
        info = self.cache.info
        expected_heads = info.num_kv_heads
        if key_states.shape[1] != expected_heads or key_states.shape[-1] != info.head_dim:
            raise ValueError(
                f"KVCache was built for a model with {expected_heads} KV heads of size {info.head_dim}, but layer "
                f"{self.layer_idx} got {key_states.shape[1]} heads of size {key_states.shape[-1]}: build one KVCache "
                "per model (KVCache(model, ...))"
            )
        if self._pending is not None:
            self._pending = None
            raise RuntimeError(
                "KVCache: the previous forward did not go through the 'kvsieve' attention "
                "(model.config._attn_implementation is "
                f"{getattr(self.cache.model_config, '_attn_implementation', None)!r}); build the cache with "
                "KVCache(model, ...) or call kvsieve.prepare_model(model)"
            )
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.store.batch:
            raise ValueError(
                f"KVCache holds batch size {self.store.batch} but got {key_states.shape[0]}; "
                "use one cache per batch (cache.reset() to reuse it)"
            )
        self._pending = (key_states, value_states)
        for follower in self.followers:
            follower.receive(key_states, value_states)
        setattr(key_states, LAYER_TAG, self)
        return key_states, value_states

    def receive(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Hold a shared forward's new entries (a follower of ``prefill_shared``; no tag, no checks)."""
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
        self._pending = (key_states, value_states)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._pending is not None, "no pending entries for this layer"
        keys, values = self._pending
        self._pending = None
        if hasattr(keys, LAYER_TAG):
            delattr(keys, LAYER_TAG)
        return keys, values

    def receive_layer_inputs(self, hidden_states: torch.Tensor) -> None:
        """Attention-input hidden states of this forward (for scorers that declare ``layer_inputs``)."""
        self._inputs = hidden_states
        for follower in self.followers:
            follower._inputs = hidden_states

    def take_layer_inputs(self) -> torch.Tensor | None:
        inputs, self._inputs = self._inputs, None
        return inputs

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        form: AttentionForm,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Called by the registered attention function with this layer's tagged keys: the engine's work."""
        self._check_module(module)
        output = self.cache.engine.attend(self, module, query, attention_mask, form, sliding_window)
        memo: dict[object, torch.Tensor] = {}  # statistics of the same entries, computed once for all
        for follower in self.followers:
            follower.cache.engine.observe_only(follower, module, query, attention_mask, form, sliding_window, memo)
        return output

    def attend_decoding(
        self, module: torch.nn.Module, query: torch.Tensor, padding: torch.Tensor | None, form: AttentionForm
    ) -> torch.Tensor:
        """:meth:`attend` for a decoding call of one query with no sliding window and SDPA's form (no soft-capping,
        no sinks): the registered attention function's direct route to :meth:`Engine.attend_decoding`."""
        if self.followers:  # a shared forward's followers observe it: the general call
            return self.attend(module, query, padding, form, None)
        self._check_module(module)
        return self.cache.engine.attend_decoding(self, module, query, padding, form)

    def _check_module(self, module: torch.nn.Module) -> None:
        """Refuse an attention module of another model instance (nothing appended; the pending entries dropped)."""
        if getattr(module, "config", self.cache.model_config) is not self.cache.model_config:
            self._pending = None
            raise ValueError(
                "this KVCache was built for another model instance; build one KVCache per model (KVCache(model, ...))"
            )

    def get_seq_length(self) -> int:
        """Logical length: tokens seen, not entries held."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        """No fixed capacity (an abstract method of transformers 5.0–5.2's layer base class)."""
        return -1

    def reset(self) -> None:
        self.store, self.seen, self.forwards, self._pending, self._inputs = None, 0, 0, None, None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.cache.engine.flush()
        if self.store is not None:
            self.store.select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.engine.flush()
        if self.store is not None:
            self.store.select_batch(torch.arange(self.store.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.cache.engine.flush()
        if self.store is not None:
            self.store.select_batch(indices)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: drop the last ``-max_length``), as transformers' caches.

        Exact for policies that never delete entries (``full``, selection policies): the entries of the
        dropped tokens are removed by position. An evicting policy cannot go back (its compactions may
        have depended on the dropped tokens), so it raises.
        """
        if self.cache.policy.evicts:
            raise NotImplementedError(
                f"KVCache({self.cache.policy.name}) evicts entries, so it cannot be rolled back (assisted generation "
                "with assistant_model= or prompt_lookup_num_tokens= crops the cache): use policy 'full' or "
                "generate without an assistant"
            )
        self.cache.engine.flush()
        target = self.seen + max_length if max_length < 0 else max_length
        if target >= self.seen:
            return
        if self.store is not None:
            self.store.keep_positions_before(max(target, 0))
        self.seen = max(target, 0)

    def offload(self) -> None:  # keys live in the store; nothing to move
        return None

    def prefetch(self) -> None:
        return None


def budget_from_bytes(model: torch.nn.Module, params: dict[str, Any]) -> dict[str, Any]:
    """``budget_bytes`` (bytes of keys and values per KV head) as ``budget``: the full-precision entries of the
    model's dtype and head size those bytes hold (a quantizing action then spends them as bytes)."""
    params = dict(params)
    budget_bytes = params.pop("budget_bytes")
    if "budget" in params or "ratio" in params:
        raise PolicyConfigError("give either budget_bytes or budget/ratio, not both")
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 1:
        raise PolicyConfigError(f"budget_bytes must be an int ≥ 1 (bytes of keys and values per KV head); "
                                f"got {budget_bytes!r}")
    element = next(model.parameters()).element_size()
    params["budget"] = full_entries_for_bytes(budget_bytes, model_info(model).head_dim, element)
    return params


class KVCache(Cache):
    """A compressed KV cache for one model and one policy.

    Args:
        model: a decoder-only causal LM (see :mod:`kvsieve.models.architectures`). The model instance is
            switched to the ``"kvsieve"`` attention (the model's own attention when no kvsieve cache is used).
        policy: a :class:`Policy`, a registered name, or None for ``full``.
        **params: policy parameters when ``policy`` is a name (e.g. ``budget=256``); ``budget_bytes=`` gives
            the budget as bytes of keys and values per KV head instead (see :func:`budget_from_bytes`).

    Everything is validated before the model is touched: an invalid policy, parameter or
    architecture raises and leaves the model as it was.
    """

    def __init__(self, model: torch.nn.Module, policy: Policy | str | None = None, **params: Any):
        name = "full" if policy is None else policy
        if "budget_bytes" in params:
            params = budget_from_bytes(model, params)
        resolved = policy if isinstance(policy, Policy) else make_policy(name, **params)
        if isinstance(policy, Policy) and params:
            raise ValueError("pass parameters inside the Policy object, not as keyword arguments")
        info = model_info(model)
        for part in (resolved.scorer, resolved.allocator, resolved.action, resolved.selector):
            check_model = getattr(part, "check_model", None)
            if check_model is not None:  # parts that read the model itself (EMS, Expected Attention: its rope)
                check_model(model.config, info)
        resolved = resolved.bind(model)  # learned scorers load their weights for this model (before touching it)
        self.policy: Policy = resolved
        self.info: ModelInfo = info
        self.model_config = model.config
        self.engine = Engine(resolved, info)
        layers = [KVLayer(self, i, info.sliding_windows[i]) for i in range(info.num_layers)]
        super().__init__(layers=layers)
        self.engine.layers = self.layers
        prepare_model(model)
        if self.engine.wants_layer_inputs():
            install_layer_input_hooks(model)

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCache:
        """An independent copy of the entries and state, still bound to the same model (its config is shared)."""
        self.engine.flush()
        memo[id(self.model_config)] = self.model_config
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            setattr(clone, key, copy.deepcopy(value, memo))
        return clone

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"KVCache was built for a model with {len(self.layers)} layers but got layer {layer_idx}: build one "
                "KVCache per model (KVCache(model, ...))"
            )
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def flush(self) -> None:
        """Apply a waiting prompt compaction now.

        A prompt's compaction waits for the prompt to end (its first decoding step), so a prompt fed in
        several forwards is compressed once. Call this before a multi-token forward that must see the
        compressed prompt instead of continuing it (teacher forcing an answer in one forward, or streaming
        text chunk by chunk with compression after each chunk). Inspection, copying and cropping flush
        by themselves.
        """
        self.engine.flush()

    @property
    def is_croppable(self) -> bool:
        return not self.policy.evicts

    @property
    def compactions(self) -> int:
        """Compactions executed so far (one per layer and firing)."""
        self.engine.flush()
        return self.engine.compactions

    def receive_layer_inputs(self, layer_idx: int | None, hidden_states: torch.Tensor) -> None:
        """Entry point of the layer-input hook (see :mod:`kvsieve.engine.layer_inputs`)."""
        if layer_idx is None or not 0 <= layer_idx < len(self.layers):
            return
        layer = self.layers[layer_idx]
        # a shared prefill's lead may not want them while a follower does (prefill_shared)
        if self.engine.wants_layer_inputs() or any(f.cache.engine.wants_layer_inputs() for f in layer.followers):
            layer.receive_layer_inputs(hidden_states)

    def reset(self) -> None:
        super().reset()
        self.engine.reset()

    # ------------------------------------------------------------------ inspection
    def head_lengths(self) -> torch.Tensor:
        """Entries held per (layer, batch, KV head), shape ``(layers, batch, kv_heads)``."""
        return torch.stack([self._store(i).lengths() for i in range(len(self.layers))])

    def _segment(self, layer_idx: int, batch_idx: int, head: int) -> tuple[LayerStore, slice]:
        store = self._store(layer_idx)
        if not 0 <= batch_idx < store.batch:
            raise IndexError(f"batch_idx must be in [0, {store.batch - 1}]; got {batch_idx}")
        if not 0 <= head < store.heads:
            raise IndexError(f"head must be in [0, {store.heads - 1}]; got {head}")
        seg = batch_idx * store.heads + head
        start, length = int(store.start[seg]), int(store.length[seg])
        return store, slice(start, start + length)

    def kept_positions(self, layer_idx: int, batch_idx: int = 0, head: int = 0) -> torch.Tensor:
        """Absolute positions of the entries one head holds, ascending (every precision tier)."""
        store, rows = self._segment(layer_idx, batch_idx, head)
        if store.tiered:
            n = int(store.lengths()[batch_idx, head])
            return store.dense().positions[batch_idx, head, :n].clone()
        return store.positions[rows].clone()

    def kept_entries(self, layer_idx: int, batch_idx: int = 0, head: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(n, head_dim)`` one head holds (post-RoPE, as the model wrote them; quantized
        entries dequantized)."""
        store, rows = self._segment(layer_idx, batch_idx, head)
        if store.tiered:
            n, view = int(store.lengths()[batch_idx, head]), store.dense()
            return view.keys[batch_idx, head, :n].clone(), view.values[batch_idx, head, :n].clone()
        return store.keys[rows].clone(), store.values[rows].clone()

    def peak_head_length(self, include_left_alone: bool = False) -> int:
        """Most entries any (layer, batch, KV head) held at any moment (right after an append).

        Sliding-window layers left alone by the policy are excluded unless ``include_left_alone``.
        """
        self.engine.flush()
        return max(
            (
                layer.store.peak_length
                for layer in self.layers
                if layer.store is not None and (include_left_alone or not layer.left_alone)
            ),
            default=0,
        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated by every layer (keys, values, positions, side data, growth slack)."""
        self.engine.flush()
        return sum(layer.store.nbytes() for layer in self.layers if layer.store is not None)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the entries actually held (growth slack excluded)."""
        self.engine.flush()
        return sum(layer.store.used_nbytes() for layer in self.layers if layer.store is not None)

    def kv_nbytes(self) -> int:
        """Bytes of keys and values actually held (what a full cache of the same length would hold)."""
        self.engine.flush()
        return sum(layer.store.kv_nbytes() for layer in self.layers if layer.store is not None)

    def storage(self) -> dict[str, int]:
        """Bytes held, measured: ``kv`` (held keys and values), ``positions``, ``side`` (per-entry side data),
        ``aux`` (store hooks: page min/max, value sums, member indices), ``allocated`` (all of it, slack included),
        ``views`` (cached views that copy entries — a ragged layer's gathered view, a tiered layer's dequantized
        view — beyond ``allocated``; the engine drops them when each layer step ends, so 0 between forwards)."""
        self.engine.flush()
        stores = [layer.store for layer in self.layers if layer.store is not None]
        positions = sum(s.total_entries() * s.positions.element_size() for s in stores)
        side = sum(s.used_nbytes() for s in stores) - sum(s.kv_nbytes() for s in stores) - positions
        return {
            "kv": sum(s.kv_nbytes() for s in stores),
            "positions": positions,
            "side": side,
            "aux": sum(hook.nbytes() for s in stores for hook in s.hooks),
            "allocated": sum(s.nbytes() for s in stores),
            "views": sum(s.view_nbytes() for s in stores),
        }

    def traffic(self) -> dict[str, float]:
        """KV bytes read at decoding, measured by the selector's store hooks on every managed layer:
        ``read_bytes`` (keys, values, page min/max, mean values actually read), ``full_bytes`` (every held
        key and value at the same steps: what full attention reads), their ratio, and ``steps`` (decoding
        steps × layers measured). Layers without a selector are not counted (they read everything)."""
        read, full, steps = 0.0, 0, 0
        for layer in self.layers:
            for hook in layer.store.hooks if layer.store is not None else ():
                measured = hook.traffic()
                if measured is not None:
                    read += float(measured[0])
                    full += measured[1]
                    steps += measured[2]
        return {"read_bytes": read, "full_bytes": float(full), "ratio": read / full if full else 1.0,
                "steps": float(steps)}

    def _store(self, layer_idx: int) -> LayerStore:
        self.engine.flush()
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx must be in [0, {len(self.layers) - 1}]; got {layer_idx}")
        store = self.layers[layer_idx].store
        if store is None:
            raise ValueError("the cache is empty: run a forward pass first")
        return store

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (logical length), which drives position ids."""
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def __repr__(self) -> str:
        return f"KVCache(policy={self.policy}, layers={len(self.layers)}, seen={self.get_seq_length()})"
