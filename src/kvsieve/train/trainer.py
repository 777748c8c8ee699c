"""Training retention gates on a frozen model (TrimKV / DBTrimKV; DBTrimKV, Bui et al., 2026,
arXiv:2605.09649, Secs. 2.2, 4.1, B.1).

Only the gate parameters train. Each step takes one training sequence (:mod:`kvsieve.train.data`), runs the
frozen model twice — the teacher with plain attention (no gradients), the student with retention-gated
attention (:mod:`kvsieve.train.student`) — and minimises ``KL(teacher ‖ student) + λ·capacity`` on the
last ``kl_tokens`` positions (the answer of a retrieval sample, and the text before it). AdamW with a
linear warm-up and cosine decay (Sec. B.1: cosine schedule; the learning rate itself was lost in
extraction: kvsieve uses 1e-2 for the gate weights and 1.5 for ``b_out``, see
:attr:`TrainConfig.bias_lr`). Deterministic for a seed: sample ``i`` depends only
on ``(seed, i)``, gates start from the seed, nothing is random afterwards. Resumable: a checkpoint (gates,
optimizer moments, step, history) is written every ``save_every`` steps and at the end, in safetensors +
JSON. A held-out split (other task seeds) is scored every ``eval_every`` steps and at the end.

Variants: ``trimkv`` (untied readout, per-head capacity), ``dbtrimkv`` (tied readout, global capacity),
``dbtrimkv_untied`` (untied readout, global capacity: the paper's no-tying ablation).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from kvsieve.gates.retention import GateConfig, RetentionGates
from kvsieve.train.data import make_sample, min_training_length
from kvsieve.train.losses import capacity_loss, kl_teacher_student
from kvsieve.train.student import GateContext, student_mode

VARIANTS: dict[str, tuple[bool, str]] = {  # name → (tied readout, capacity scope)
    "trimkv": (False, "head"),
    "dbtrimkv": (True, "global"),
    "dbtrimkv_untied": (False, "global"),
}


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (validated on construction)."""

    variant: str = "dbtrimkv"
    budget: int = 128  #: ``M``: entries per head (global: ``L·H·M`` in total)
    capacity_weight: float = 1.0  #: ``λ``
    steps: int = 28
    lr: float = 1e-2
    #: Learning rate of ``b_out``: Adam moves a parameter by about its rate per step, so with the paper's
    #: ``b_out = 18`` start a CPU run of tens of steps needs a larger rate on the bias to reach β < 1.
    bias_lr: float = 1.5
    weight_decay: float = 0.0
    warmup: int = 3
    gate_hidden: int = 32
    lengths: tuple[int, ...] = (1024, 1536, 2048)
    kl_tokens: int = 256
    block_size: int = 256
    seed: int = 0
    heldout: int = 4
    eval_every: int = 20
    save_every: int = 10
    max_minutes: float | None = None
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {tuple(VARIANTS)}; got {self.variant!r}")
        for name, low in (("budget", 1), ("steps", 1), ("gate_hidden", 1), ("kl_tokens", 1), ("block_size", 1),
                          ("heldout", 0), ("eval_every", 1), ("save_every", 1), ("warmup", 0), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TrainConfig.{name} must be an int ≥ {low}; got {value!r}")
        for name in ("capacity_weight", "lr", "bias_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be a finite number ≥ 0; got {value!r}")
        shortest = min_training_length()
        if not self.lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < shortest for n in self.lengths):
            raise ValueError(f"TrainConfig.lengths must be ints ≥ {shortest} (the shortest length every retrieval "
                             f"task of the training mix can fill); got {self.lengths!r}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"TrainConfig.max_minutes must be > 0 or None; got {self.max_minutes!r}")


@dataclass
class TrainResult:
    gates: RetentionGates
    history: list[dict[str, float]] = field(default_factory=list)
    heldout: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    steps_done: int = 0


def _losses(
    model: torch.nn.Module, gates: RetentionGates, ids: torch.Tensor, config: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    keep = min(config.kl_tokens, ids.shape[1])
    with torch.no_grad():
        teacher = model(input_ids=ids, logits_to_keep=keep).logits
    with student_mode(model):
        ctx = GateContext(gates, config.block_size)
        student = model(input_ids=ids, logits_to_keep=keep, gate_context=ctx).logits
    masses = [ctx.masses[i] for i in sorted(ctx.masses)]
    scope = VARIANTS[config.variant][1]
    return kl_teacher_student(teacher, student), capacity_loss(masses, config.budget, scope)


def evaluate_heldout(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, gates: RetentionGates, config: TrainConfig
) -> dict[str, float]:
    """Mean KL, capacity and total loss over the held-out split (no gradients)."""
    kls, caps = [], []
    with torch.no_grad():
        for index in range(config.heldout):
            sample = make_sample(tokenizer, index, "heldout", config.seed, config.lengths)
            kl, cap = _losses(model, gates, torch.tensor([sample.ids]), config)
            kls.append(float(kl))
            caps.append(float(cap))
    if not kls:
        return {}
    kl_mean, cap_mean = sum(kls) / len(kls), sum(caps) / len(caps)
    return {"kl": kl_mean, "capacity": cap_mean, "loss": kl_mean + config.capacity_weight * cap_mean}


def _lr_factor(config: TrainConfig, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < config.warmup:
        return (step + 1) / (config.warmup + 1)
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def _save_checkpoint(path: Path, gates: RetentionGates, optimizer: torch.optim.Optimizer, step: int,
                     result: TrainResult, config: TrainConfig, fingerprint: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"gates.{k}": v.detach().contiguous().cpu() for k, v in gates.state_dict().items()}
    names = [n for n, _ in gates.named_parameters()]
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"opt.{names[index]}.{key}"] = torch.as_tensor(value).detach().contiguous().cpu()
    save_file(tensors, str(path / "checkpoint.safetensors"))
    meta = {"step": step, "history": result.history, "heldout": result.heldout, "seconds": result.seconds,
            "config": asdict(config), "gate_config": asdict(gates.config), "model_fingerprint": fingerprint}
    (path / "checkpoint.json").write_text(json.dumps(meta, indent=1) + "\n")


def _load_checkpoint(path: Path, gates: RetentionGates, optimizer: torch.optim.Optimizer,
                     result: TrainResult, config: TrainConfig, fingerprint: str) -> int:
    try:
        meta = json.loads((path / "checkpoint.json").read_text(encoding="utf-8"))
        tensors = load_file(str(path / "checkpoint.safetensors"))
    except Exception as err:  # a truncated or hand-edited checkpoint: say which, and how to start over
        raise ValueError(f"checkpoint in {path} cannot be read ({type(err).__name__}: {err}); pass --no-resume "
                         "to start over, or another --output") from None
    if meta.get("model_fingerprint") != fingerprint:
        raise ValueError(f"checkpoint {path} was written for another model (fingerprint "
                         f"{meta.get('model_fingerprint')!r}, this model {fingerprint!r}); use another --output "
                         "or --no-resume")
    saved = {k: v for k, v in meta["config"].items() if k not in ("max_minutes", "steps")}
    mine = {k: v for k, v in asdict(config).items() if k not in ("max_minutes", "steps")}
    saved["lengths"] = tuple(saved["lengths"])
    if saved != mine:
        diff = sorted(k for k in mine if mine[k] != saved.get(k))
        raise ValueError(f"checkpoint {path} was written with other settings ({diff}); use another output folder")
    gates.load_state_dict({k[len("gates."):]: v for k, v in tensors.items() if k.startswith("gates.")})
    names = [n for n, _ in gates.named_parameters()]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            name, _, field_name = key[len("opt."):].rpartition(".")
            state.setdefault(names.index(name), {})[field_name] = value
    if state:
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    result.history, result.heldout, result.seconds = meta["history"], meta["heldout"], meta["seconds"]
    return int(meta["step"])


def train_gates(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    config: TrainConfig | None = None,
    output_dir: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
) -> TrainResult:
    """Train retention gates for ``model`` (frozen); returns the gates and the loss history.

    With ``output_dir``, checkpoints go to ``output_dir/checkpoint.*`` (resumed from when ``resume``) and
    the final gates to ``output_dir/gates.{safetensors,json}``. The model's parameters are never changed.
    """
    config = config or TrainConfig()
    tied, _ = VARIANTS[config.variant]
    gate_config = GateConfig.for_model(model, config.gate_hidden, tied)
    fingerprint = gate_config.model_fingerprint
    gates = RetentionGates(gate_config, seed=config.seed)
    device = next(iter(model.parameters())).device
    gates = gates.to(device)
    groups = [  # named_parameters order (w_in, b_in, w_out, b_out): checkpoints index optimizer state by it
        {"params": [gates.w_in, gates.b_in, gates.w_out], "base_lr": config.lr},
        {"params": [gates.b_out], "base_lr": config.bias_lr, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
    result = TrainResult(gates)
    out = Path(output_dir) if output_dir is not None else None
    start = 0
    if out is not None and resume and (out / "checkpoint.json").is_file():
        start = _load_checkpoint(out, gates, optimizer, result, config, fingerprint)
    frozen = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    began = time.monotonic() - result.seconds
    bar = tqdm(range(start, config.steps), initial=start, total=config.steps, disable=not progress,
               desc=f"train {config.variant}")
    step = start
    try:
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = group["base_lr"] * _lr_factor(config, step)
            sample = make_sample(tokenizer, step, "train", config.seed, config.lengths)
            ids = torch.tensor([sample.ids], device=device)
            kl, cap = _losses(model, gates, ids, config)
            loss = kl + config.capacity_weight * cap
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(gates.parameters(), config.grad_clip)
            optimizer.step()
            result.seconds = time.monotonic() - began
            kl_value, cap_value = kl.item(), cap.item()
            result.history.append({"step": step, "kl": kl_value, "capacity": cap_value,
                                   "loss": kl_value + config.capacity_weight * cap_value,
                                   "tokens": ids.shape[1], "source": sample.source, "seconds": result.seconds})
            bar.set_postfix(kl=f"{kl_value:.4f}", cap=f"{cap_value:.3f}", src=sample.source[:9])
            done = step + 1
            over_time = config.max_minutes is not None and result.seconds > 60 * config.max_minutes
            if done % config.eval_every == 0 and config.heldout:
                result.heldout.append({"step": done, **evaluate_heldout(model, tokenizer, gates, config)})
            if out is not None and (done % config.save_every == 0 or over_time):
                _save_checkpoint(out, gates, optimizer, done, result, config, fingerprint)
            if over_time:
                break
        done = step + 1 if config.steps > start else start
        if config.heldout and (not result.heldout or result.heldout[-1]["step"] != done):
            result.heldout.append({"step": done, **evaluate_heldout(model, tokenizer, gates, config)})
        result.seconds = time.monotonic() - began
        result.steps_done = done
        if out is not None:
            _save_checkpoint(out, gates, optimizer, done, result, config, fingerprint)
            summary = {"variant": config.variant, "budget": config.budget, "steps": done,
                       "seconds": round(result.seconds, 1), "config": asdict(config),
                       "heldout": result.heldout[-1] if result.heldout else {}}
            final = RetentionGates(replace(gates.config, training=summary), seed=None)
            final.load_state_dict(gates.state_dict())
            final.save(out / "gates")
    finally:
        bar.close()
        for param, flag in zip(model.parameters(), frozen, strict=True):
            param.requires_grad_(flag)
    return result
