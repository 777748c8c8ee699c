"""What kvsieve needs from a decoder model, detected generically from its config and its modules.

No table of model types: kvsieve serves any decoder-only causal LM whose attention is softmax
attention over a per-layer key/value cache called through transformers' attention interface. It reads

* **the config** (:func:`check_config`, also used on a bare ``config.json`` before any weight is read):
  refuses multi-head latent attention (``kv_lora_rank``/``q_lora_rank``: DeepSeek-V2/V3, Kimi), linear,
  recurrent or hybrid layers (``layer_types`` with anything but full/sliding attention, or the state-space /
  recurrence fields of Mamba, Jamba, Falcon-H1, LFM2, RWKV, RecurrentGemma...), encoder-decoder models and
  bidirectional attention, naming the reason;
* **the modules** (:func:`model_info`): the decoder layers (``model.model.layers``, else the one
  ``ModuleList`` of ``num_hidden_layers`` blocks that hold an attention module), each layer's attention
  module (the child with an output projection and q/k/v or fused qkv projections), head counts and head
  size (config, checked against the projections), and the sliding-window pattern: each attention
  module's own ``sliding_window`` attribute where it has one (Qwen2/3, Gemma2/3, GPT-OSS, SmolLM3), else
  ``config.layer_types`` with ``config.sliding_window``, else a global ``config.sliding_window`` (Mistral,
  Phi3: the window applies to every layer).

Sliding-window layers of a hybrid model are left alone by every policy (they keep the model's own window
and are trimmed to it), as Gemma2/3's and GPT-OSS's local layers need. Soft-capping (Gemma2) and learned
sinks (GPT-OSS) are not read here: the model passes them to the attention function at every call
(``softcap=``, ``s_aux=``), and the kernel honours them (:class:`kvsieve.attention.kernel.AttentionForm`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: ``config.layer_types`` values kvsieve serves.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

#: Architectures the test suite builds from configs and checks against plain transformers (``model_type``).
TESTED_MODEL_TYPES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text", "olmo2", "granite",
    "smollm3", "gpt_oss",
)
#: Kept for callers of the former table: the tested model types (detection no longer depends on it).
ARCHITECTURES = TESTED_MODEL_TYPES

#: Config fields that mark multi-head latent attention (keys/values cached as a low-rank latent).
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
#: Config fields that mark recurrent, state-space, convolutional or linear-attention layers.
_RECURRENT_FIELDS = (
    "ssm_state_size", "state_size", "mamba_d_state", "mamba_d_conv", "mamba_n_heads", "mamba_expand",
    "layers_block_type", "block_types", "hybrid_override_pattern", "attn_layer_period", "attn_layer_indices",
    "linear_num_key_heads", "linear_num_value_heads", "linear_conv_kernel_dim", "conv_L_cache", "lru_width",
    "rescale_every", "full_attn_idxs",
)
#: Names of output projections and of q/k/v projection sets an attention module may have.
_OUTPUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "wo")
_QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("qkv_proj",), ("query_key_value",), ("Wqkv",), ("c_attn",), ("wqkv",))


class UnsupportedArchitectureError(ValueError):
    """A model kvsieve cannot serve correctly; the message names the reason."""


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _sub_configs(config: Any) -> Iterable[Any]:
    """The config and its text sub-config (multimodal wrappers keep the decoder's fields there)."""
    yield config
    text = _get(config, "text_config")
    if text is not None:
        yield text


def check_config(config: Any, source: str | None = None) -> None:
    """Refuse a config (a ``PretrainedConfig`` or a ``config.json`` mapping) kvsieve cannot serve correctly.

    Reads only the config, so :func:`kvsieve.load_model` calls it before any weight is read. Raises
    :class:`UnsupportedArchitectureError` naming the reason: encoder-decoder, multi-head latent attention,
    linear/recurrent/hybrid layers, bidirectional attention, or no attention heads at all.
    """
    where = f"{source}: " if source else ""
    model_type = _get(config, "model_type")
    name = f"{where}model_type {model_type!r}"
    if _get(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"{name} is an encoder-decoder model; kvsieve serves decoder-only causal LMs (its cache holds one "
            "self-attention key/value stream per layer, not cross-attention)"
        )
    for sub in _sub_configs(config):
        mla = [field for field in _MLA_FIELDS if _get(sub, field) is not None]
        if mla:
            raise UnsupportedArchitectureError(
                f"{name} uses multi-head latent attention ({', '.join(mla)} in the config: keys and values are "
                "cached as a compressed latent and expanded per head inside the attention module), which kvsieve "
                "cannot serve: its stores hold per-head keys and values"
            )
        types = _get(sub, "layer_types")
        if types is not None:
            other = sorted({str(t) for t in types if t not in ATTENTION_LAYER_TYPES})
            if other:
                raise UnsupportedArchitectureError(
                    f"{name} has layers of type {other} (config.layer_types); kvsieve serves only softmax "
                    f"attention layers ({', '.join(ATTENTION_LAYER_TYPES)}): linear, recurrent or hybrid layers keep "
                    "a state, not a key/value cache"
                )
        recurrent = [field for field in _RECURRENT_FIELDS if _get(sub, field) is not None]
        if recurrent:
            raise UnsupportedArchitectureError(
                f"{name} has linear, recurrent or state-space layers ({', '.join(recurrent)} in the config); "
                "kvsieve serves only models whose every layer is softmax attention over a key/value cache"
            )
        if _get(sub, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError(
                f"{name} uses bidirectional attention (use_bidirectional_attention); kvsieve serves causal LMs"
            )
    text = next(iter(reversed(list(_sub_configs(config)))))
    if _get(text, "num_attention_heads") is None or _get(text, "num_hidden_layers") is None:
        raise UnsupportedArchitectureError(
            f"{name} has no num_attention_heads/num_hidden_layers in its config: not a decoder transformer "
            "kvsieve can read"
        )


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where the pieces kvsieve reads live in one model, as detected from its modules.

    ``layers_path``: attribute path from the model to the decoder layers; ``attention_attr``: the attention
    module's name inside a layer; ``output_proj_attr``: its output projection ``W_O``.
    """

    model_type: str = "llama"
    layers_path: tuple[str, ...] = ("model", "layers")
    attention_attr: str = "self_attn"
    output_proj_attr: str = "o_proj"


@dataclass(frozen=True)
class ModelInfo:
    """Shapes and modules of one loaded model that the cache and policies need."""

    spec: ArchitectureSpec
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...]

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def left_alone(self) -> tuple[bool, ...]:
        """Layers no policy touches: the sliding-window layers of a hybrid model (Gemma2/3's local layers).

        When *every* layer has a window (Mistral or Phi3 configs with ``sliding_window`` set), the window
        is only a mask: the policy still manages every layer, and entries outside the window are dropped.
        """
        hybrid = any(w is None for w in self.sliding_windows)
        return tuple(hybrid and w is not None for w in self.sliding_windows)

    @property
    def managed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, alone in enumerate(self.left_alone) if not alone)


def _attention_child(layer: torch.nn.Module) -> tuple[str, str] | None:
    """``(child name, output projection name)`` of the attention module of one decoder layer, or None."""
    found = []
    for name, child in layer.named_children():
        # Linear projections only: ``W_O`` is read as a Linear weight (ReST-KV, CAOTE); GPT-2's Conv1D is not one
        out = next((o for o in _OUTPUT_NAMES if isinstance(getattr(child, o, None), torch.nn.Linear)), None)
        has_qkv = any(all(isinstance(getattr(child, p, None), torch.nn.Linear) for p in names) for names in _QKV_NAMES)
        if out is not None and has_qkv:
            found.append((name, out))
    if len(found) > 1:  # e.g. self- and cross-attention: prefer the self-attention module
        found = [f for f in found if f[0] == "self_attn"] or found
    return found[0] if len(found) == 1 else None


def _describe(model: torch.nn.Module) -> str:
    return f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r})"


def _find_layers(model: torch.nn.Module, num_layers: int) -> tuple[tuple[str, ...], torch.nn.ModuleList]:
    """The decoder layers: ``model.model.layers`` where it is, else the one fitting ``ModuleList``."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return ("model", "layers"), layers
    candidates = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers and len(module) > 0
        and all(_attention_child(block) is not None for block in module)
    ]
    if len(candidates) != 1:
        raise UnsupportedArchitectureError(
            f"{_describe(model)}: kvsieve cannot find its decoder layers (a ModuleList of {num_layers} blocks "
            "each holding an attention module with Linear q/k/v (or fused qkv) and output projections); found "
            f"{len(candidates)} candidates. Tested architectures: {sorted(TESTED_MODEL_TYPES)}"
        )
    name, module = candidates[0]
    return tuple(name.split(".")), module


def architecture_of(model: torch.nn.Module) -> ArchitectureSpec:
    """Detect where the decoder layers, attention modules and output projections of ``model`` live.

    Raises :class:`UnsupportedArchitectureError` (naming the reason) for a config kvsieve cannot serve
    (:func:`check_config`) or a model whose layers or attention modules it cannot find.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedArchitectureError(f"{type(model).__name__} has no config: not a transformers model")
    check_config(config)
    text = getattr(config, "text_config", None) or config
    path, layers = _find_layers(model, text.num_hidden_layers)
    names = [_attention_child(layer) for layer in layers]
    if names[0] is None or any(n != names[0] for n in names):
        missing = next(i for i, n in enumerate(names) if n is None or n != names[0])
        raise UnsupportedArchitectureError(
            f"{_describe(model)}: decoder layer {missing} has no attention module kvsieve recognises (a child with "
            f"Linear q/k/v or fused qkv projections and a Linear output projection, one of {_OUTPUT_NAMES}), or "
            f"not the same as layer 0's. Tested architectures: {sorted(TESTED_MODEL_TYPES)}"
        )
    attention_attr, output_attr = names[0]
    return ArchitectureSpec(str(getattr(config, "model_type", None)), path, attention_attr, output_attr)


def decoder_layers(model: torch.nn.Module, spec: ArchitectureSpec | None = None) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` for every tested architecture)."""
    spec = spec or architecture_of(model)
    module: Any = model
    for name in spec.layers_path:
        module = getattr(module, name)
    return module  # type: ignore[no-any-return]


def attention_modules(model: torch.nn.Module, spec: ArchitectureSpec | None = None) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order."""
    spec = spec or architecture_of(model)
    return [getattr(layer, spec.attention_attr) for layer in decoder_layers(model, spec)]


def _sliding_windows(config: Any, modules: list[torch.nn.Module]) -> tuple[int | None, ...]:
    """Per layer: the module's own ``sliding_window`` where it has one (what it passes to the attention
    function), else ``config.layer_types`` with ``config.sliding_window``, else the global window."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    windows = []
    for i, module in enumerate(modules):
        if hasattr(module, "sliding_window"):
            windows.append(module.sliding_window)
        elif types is not None:
            windows.append(window if types[i] == "sliding_attention" else None)
        else:
            windows.append(window)
    return tuple(None if w is None else int(w) for w in windows)


def model_info(model: torch.nn.Module) -> ModelInfo:
    """Read layer count, head counts, head size and sliding windows of a model kvsieve can serve."""
    spec = architecture_of(model)
    config = getattr(model.config, "text_config", None) or model.config
    modules = attention_modules(model, spec)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = (getattr(modules[0], "head_dim", None) or getattr(config, "head_dim", None)
                or config.hidden_size // heads)
    k_proj = getattr(modules[0], "k_proj", None)
    if isinstance(k_proj, torch.nn.Linear) and k_proj.out_features != kv_heads * head_dim:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}: k_proj gives {k_proj.out_features} features, not num_key_value_heads "
            f"({kv_heads}) × head_dim ({head_dim}); kvsieve cannot read its key/value layout"
        )
    if heads % kv_heads:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}: {heads} query heads are not a multiple of {kv_heads} KV heads"
        )
    windows = _sliding_windows(config, modules)
    return ModelInfo(spec, len(modules), heads, kv_heads, int(head_dim), windows)


def output_projection(model: torch.nn.Module, layer_idx: int) -> torch.nn.Linear:
    """The attention output projection ``W_O`` of layer ``layer_idx``."""
    spec = architecture_of(model)
    attention = getattr(decoder_layers(model, spec)[layer_idx], spec.attention_attr)
    return getattr(attention, spec.output_proj_attr)  # type: ignore[no-any-return]
