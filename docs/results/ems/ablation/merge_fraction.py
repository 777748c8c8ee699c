import sys
import time

import torch

torch.set_num_threads(1)
from dataclasses import dataclass

import kvsieve
from kvsieve.engine.step import MERGE_COUNT
from kvsieve.eval.tasks import TASKS
from kvsieve.parts.actions.evict_merge import EvictThenMerge
from kvsieve.parts.scorers.global_local import GlobalLocal
from kvsieve.policies import Policy
from kvsieve.transformers_adapter import cache_kwargs

STATS = []
@dataclass(frozen=True)
class Rec(EvictThenMerge):
    def assign(self, plan, scores, step):
        super().assign(plan, scores, step)
        src = plan.merge_source
        n_merged = int((src >= 0).sum()) if src is not None else 0
        STATS.append((step.layer_idx, n_merged, int(plan.counts.sum())))
model, tok = kvsieve.load_default_model()
task = TASKS[sys.argv[1]]
sample = task.make_sample(tok, 2048, 0, 0)
ids = torch.tensor([sample.prompt_ids])
budget = int(sys.argv[2])
pol = Policy(scorer=GlobalLocal(), action=Rec(tau=float(sys.argv[3])), budget=budget, schedule="prefill", name="rec")
cache = kvsieve.KVCache(model, pol)
t=time.time()
with torch.no_grad():
    model(ids, **cache_kwargs(model, cache), logits_to_keep=1)
cache.flush()
print("prefill", time.time()-t)
L = ids.shape[1]
tot_m = sum(s[1] for s in STATS); tot_k = sum(s[2] for s in STATS)
print("merged per layer (of", (L - budget)*3, "dropped):", [s[1] for s in STATS])
counts = torch.stack([cache.layers[i].store.dense().extras[MERGE_COUNT].flatten() for i in range(30)])
print("max count per layer", counts.amax(1).tolist())
print("frac of dropped merged", tot_m / (30*3*(L-budget)))
