"""How many (layer, KV head) pairs lose each digit token of the pass key at 896 of 1024 entries.

Seed 0, depth 0.5 of the ``kvsieve niah`` demo (pass key 60494); snapkv vs restkv.
Run: ``PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/issue13/needle_digits_check.py``.
"""

import torch

import kvsieve
from kvsieve.eval.tasks.passkey_prompt import make_passkey_sample
from kvsieve.transformers_adapter import cache_kwargs

torch.set_num_threads(1)
model, tokenizer = kvsieve.load_default_model()
sample = make_passkey_sample(tokenizer, 1024, 0.5, 0)
ids = torch.tensor([sample.prompt_ids])
digits = [i for i in range(sample.needle_start, sample.needle_end)
          if tokenizer.decode([sample.prompt_ids[i]]).strip().isdigit()]
print("digit positions", digits, [tokenizer.decode([sample.prompt_ids[i]]) for i in digits])
for name in ("snapkv", "restkv"):
    cache = kvsieve.KVCache(model, name, budget=896)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
    cache.flush()
    missing = dict.fromkeys(digits, 0)
    for layer in range(model.config.num_hidden_layers):
        for head in range(model.config.num_key_value_heads):
            kept = set(cache.kept_positions(layer, 0, head).tolist())
            for position in digits:
                missing[position] += position not in kept
    pairs = model.config.num_hidden_layers * model.config.num_key_value_heads
    print(name, f"heads (of {pairs}) missing each digit:",
          [(tokenizer.decode([sample.prompt_ids[p]]), missing[p]) for p in digits])
