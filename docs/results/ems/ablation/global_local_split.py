"""EMS App. E statistic on the default model: of the kept non-window entries (top B − w by the Global-Local
score), the share whose score comes from the mean-aligned global term (s_glo·mean(s_loc)/mean(s_glo) > s_loc)."""
import sys

import torch

torch.set_num_threads(1)
from dataclasses import dataclass

import kvsieve
from kvsieve.eval.tasks import TASKS
from kvsieve.parts.scorers.global_local import GLOBAL, LOCAL_CUR, LOCAL_PAST, GlobalLocal
from kvsieve.policies import Policy
from kvsieve.transformers_adapter import cache_kwargs

SHARE = []
@dataclass(frozen=True)
class Split(GlobalLocal):
    def score(self, step, nominal):
        out = super().score(step, nominal)
        ex = step.view.extras
        g, loc = ex[GLOBAL].float(), ex[LOCAL_PAST].float() + ex[LOCAL_CUR].float()
        ratio = loc.sum(-1, keepdim=True) / g.sum(-1, keepdim=True)
        from_global = (g * ratio > loc)
        finite = torch.isfinite(out)
        k = int(nominal.max()) - self.window
        top = torch.topk(out.masked_fill(~finite, -1e30), k, dim=-1).indices
        SHARE.append(float(from_global.gather(-1, top).float().mean()))
        return out
model, tok = kvsieve.load_default_model()
for task in sys.argv[2:]:
    SHARE.clear()
    sample = TASKS[task].make_sample(tok, 2048, 0, 0)
    cache = kvsieve.KVCache(model, Policy(scorer=Split(), budget=int(sys.argv[1]), schedule="prefill", name="split"))
    with torch.no_grad():
        model(torch.tensor([sample.prompt_ids]), **cache_kwargs(model, cache), logits_to_keep=1)
    cache.flush()
    print(task, "budget", sys.argv[1], "global share of kept centres, mean over layers %.2f" % (sum(SHARE) / len(SHARE)),
          "per layer", [round(s, 2) for s in SHARE])
