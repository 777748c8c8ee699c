"""Compositions found by ``kvsieve tune`` that won on held-out data, shipped as named presets.

``tuned_smollm2_64`` — the best composition of two searches on the default model (SmolLM2-135M-Instruct) at
64 entries per KV head (``docs/results/tune/``: 24 trials each on 12 calibration samples at 2k tokens; both
searches converged on it): FastCAOTE over TOVA's last-query attention (CAOTE, Eq. 8), AdaKV's per-head split
(α = 0.249) and mixed precision — 21% of the byte budget holds the best entries in the model dtype, 79% the
next ones at 4 bits (KIVI groups), the rest is evicted. On held-out RULER samples (seed 2,000,001, other essays;
6 tasks × 2k/4k × 4 = 48 paired samples) at equal KV bytes it beats every seed method and baseline (dbtrimkv
by +0.44 ± 0.18 KL per answer token and +13 points of exact match; restkv by ~1 KL); at 8k (12 paired
samples) it is within noise of dbtrimkv. The parameters are the search's, unrounded (what was evaluated).
Tuned for one model and one budget: on another model or budget, run ``kvsieve tune`` (the 128-entry
search's best tied dbtrimkv on held-out data, so it is not shipped).
"""

from __future__ import annotations

from kvsieve.core.preset import Preset
from kvsieve.parts.actions.quantize import Quantize
from kvsieve.parts.allocators.adaptive import Adaptive
from kvsieve.parts.schedules import Prefill
from kvsieve.parts.scorers.caote import Caote
from kvsieve.parts.scorers.tova import LastQueryAttention

PRESETS = (
    Preset("tuned_smollm2_64", "kvsieve tune's best on SmolLM2-135M at 64 entries/head: tova_fastcaote + adaptive "
           "(α 0.249) + 4-bit mixed precision (low share 0.794); beats every seed method on held-out 2k/4k data",
           scorer=Caote(base=LastQueryAttention(), fast=True), allocator=Adaptive(alpha=0.24924881397973203),
           action=Quantize(bits=4, low_share=0.793875268920326), schedule=Prefill()),
)
