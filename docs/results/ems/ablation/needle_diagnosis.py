import sys

import torch

torch.set_num_threads(1)
import kvsieve
from kvsieve.cache.shared_prefill import prefill_shared
from kvsieve.eval.tasks import TASKS

model, tok = kvsieve.load_default_model()
sample = TASKS[sys.argv[1]].make_sample(tok, 2048, 0, 0)
ids = torch.tensor([sample.prompt_ids])
ref = sample.references[0]
# locate the needle value tokens in the prompt
val_ids = tok(" " + ref, add_special_tokens=False).input_ids
seq = sample.prompt_ids
pos = [i for i in range(len(seq)) if seq[i:i+len(val_ids)] == val_ids]
if not pos:
    val_ids = tok(ref, add_special_tokens=False).input_ids
    pos = [i for i in range(len(seq)) if seq[i:i+len(val_ids)] == val_ids]
needle = torch.arange(pos[0], pos[0]+len(val_ids))
print("needle at", needle.tolist(), "prompt", len(seq))
B = int(sys.argv[2])
caches = {
 "snapkv7": kvsieve.KVCache(model, "snapkv", budget=B, kernel_size=7),
 "ems_evict": kvsieve.KVCache(model, "ems", budget=B, tau=1.0, schedule="prefill"),
 "glo_only": kvsieve.KVCache(model, "h2o", budget=B, recent_ratio=0.0),
}
with torch.no_grad():
    prefill_shared(model, ids, list(caches.values()))
for name, c in caches.items():
    c.flush()
    fr = []
    for l in range(30):
        p = c.layers[l].store.dense().positions[0]  # (H, L)
        fr.append(round(float(torch.isin(needle, p[0]).float().mean()*1/3 + torch.isin(needle, p[1]).float().mean()/3 + torch.isin(needle, p[2]).float().mean()/3), 2))
    print(name, "needle kept frac per layer", fr)
for name, c in caches.items():
    sink = [int(sum(bool((c.layers[l].store.dense().positions[0, h] == 0).any()) for h in range(3))) for l in range(30)]
    print(name, "heads keeping pos 0 per layer", sink)
a, b = caches["snapkv7"], caches["ems_evict"]
ov = []
for l in range(30):
    pa, pb = a.layers[l].store.dense().positions[0], b.layers[l].store.dense().positions[0]
    ov.append(round(float(sum(torch.isin(pa[h], pb[h]).float().mean() for h in range(3)) / 3), 2))
print("overlap", ov)
# run the answer through each (teacher forcing) and compute KL vs full
full = kvsieve.KVCache(model, "full")
ans = torch.tensor([tok(sample.answer if hasattr(sample,'answer') else " " + ref, add_special_tokens=False).input_ids]) if False else torch.tensor([val_ids])
import copy

from kvsieve.transformers_adapter import cache_kwargs

with torch.no_grad():
    model(ids, **cache_kwargs(model, full))
    lf = model(ans, **cache_kwargs(model, full)).logits.log_softmax(-1)
    for name, c in caches.items():
        lc = model(ans, **cache_kwargs(model, copy.deepcopy(c))).logits.log_softmax(-1)
        print(name, "KL", float((lf.exp() * (lf - lc)).sum(-1).mean()))
