"""``kvzip`` scorer (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
NeurIPS 2025, arXiv:2505.23416; public code: github.com/snu-mllab/KVzip and kvpress ``KVzipPress``).

A context's entries are scored without knowing any question: after the context is prefilled, the model is
made to *repeat* it — the reconstruction prompt (``"\\n\\nRepeat the previous context exactly."``) followed by
the context tokens themselves, teacher-forced — and each entry's importance is the largest attention it
receives from any reconstruction query of any query head of its GQA group (Sec. 3.2, Eq. 2)::

    s_j = max_{t ∈ repeat, h ∈ group} A_h[t, j]

Contexts longer than ``chunk_size`` are repeated chunk by chunk (Sec. 3.3): the first chunk after the repeat
prompt, each later one after ``"\\n\\nRepeat the part of the previous context exactly, starting with"`` and
the last ``overlap`` tokens of the chunk before; an entry keeps the largest score any chunk gave it. The first
``n_sink`` tokens are always kept. The preset ranks entries over every layer and KV head at once (the
``global`` allocator: kvpress's default, non-``layerwise``), so heads and layers keep different numbers.

The reconstruction runs as *probe* forwards (:mod:`kvsieve.engine.probe`, driven by
:func:`kvsieve.generation.reconstruction.reconstruct`; :func:`kvsieve.compress_context` calls it): the repeat
tokens attend to the whole held context and causally to each other, their own entries are dropped afterwards,
and the cache is compressed once, after the last chunk. A KVzip cache never compresses on ordinary forwards
(the compressed context is question-agnostic: questions and answers are appended). Cost: one extra forward
over the context plus the prompt (two to three times the prefill, as the paper and kvpress state; measured in
``docs/results/new_methods/``).

How kvsieve differs from the references: the maxima are of the attention the model computes, over every held
entry; kvpress, to bound memory, normalises each chunk's attention over the sinks, that chunk's context
entries and the repeat tokens only (identical for a context of one chunk). Without a chat template the repeat
prompt ends in ``"\\n"`` as in kvpress; with one, kvsieve still repeats plain text (kvpress wraps the prompt in
the template's user turn). KVzip+'s normalisation (``‖h‖``, ``‖W_O v‖``) is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.cache.store import SideSpec
from kvsieve.core.part import PolicyConfigError, require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import COLUMN_MAXIMA, LayerStep
from kvsieve.ops.gqa import reduce_groups
from kvsieve.parts.allocators.global_budget import GlobalBudget
from kvsieve.parts.scorers.base import Scorer, check_sinks_and_window, protect_sinks_and_recent

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec

#: Side data: the largest attention each entry received from a reconstruction query so far.
RECONSTRUCTION_SCORE = "kvzip_score"


@dataclass(frozen=True)
class ContextReconstruction(Scorer):
    """Max attention each entry receives while the model repeats the context (probe forwards)."""

    name: ClassVar[str] = "kvzip"
    NEEDS: ClassVar[frozenset[str]] = frozenset({COLUMN_MAXIMA})
    SIDE: ClassVar[tuple[SideSpec, ...]] = (SideSpec(RECONSTRUCTION_SCORE),)
    SCHEDULES: ClassVar[tuple[str, ...]] = ("prefill",)
    #: Scores come from probe forwards only (:mod:`kvsieve.engine.probe`); no plan before them.
    RECONSTRUCTS: ClassVar[bool] = True
    OBSERVES_PROBES_ONLY: ClassVar[bool] = True
    n_sink: int = 4
    chunk_size: int = 2048
    overlap: int = 8
    window: int = 0
    repeat_prompt: str = "\n\nRepeat the previous context exactly."
    continue_prompt: str = "\n\nRepeat the part of the previous context exactly, starting with"
    prompt_suffix: str = "\n"

    def validate(self) -> None:
        require_int(self.name, "n_sink", self.n_sink, 0)
        require_int(self.name, "chunk_size", self.chunk_size, 1)
        require_int(self.name, "overlap", self.overlap, 0)
        require_int(self.name, "window", self.window, 0)
        for field in ("repeat_prompt", "continue_prompt", "prompt_suffix"):
            if not isinstance(getattr(self, field), str):
                raise PolicyConfigError(f"{self.name}: {field} must be a string; got {getattr(self, field)!r}")
        if not self.repeat_prompt.strip():
            raise PolicyConfigError(f"{self.name}: repeat_prompt must be a non-empty instruction")

    def check(self, spec: BudgetSpec) -> None:
        check_sinks_and_window(spec, self.n_sink, self.window)

    def observe(self, step: LayerStep) -> dict[str, torch.Tensor]:
        """On a probe forward: raise each entry's score to the largest attention a repeat query gave it (an
        additive update of the side data: ``max(new − old, 0)``); otherwise nothing."""
        if not step.probing:
            return {}
        maxima = reduce_groups(step.all_column_maxima(), step.kv_heads, "max")
        old = step.view.extras[RECONSTRUCTION_SCORE].float()
        return {RECONSTRUCTION_SCORE: (maxima - old).clamp(min=0.0).masked_fill(~step.entry_valid(), 0.0)}

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return step.view.extras[RECONSTRUCTION_SCORE].float()

    def protect(self, scores: torch.Tensor, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        """The first ``n_sink`` real tokens of each row and the newest ``window`` always kept."""
        return protect_sinks_and_recent(scores, step, self.n_sink, self.window)


PRESETS = (
    Preset("kvzip", "max attention during context reconstruction (query-agnostic), one budget over all layers "
           "and heads", scorer=ContextReconstruction(), allocator=GlobalBudget()),
)
