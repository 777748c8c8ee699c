"""Where the learned gates put the needle: mean log β of the needle's value tokens vs the rest, and how many
entries of the needle's value and of the distractor values (the prompt's other 7-digit numbers) each cache
keeps, in how many heads the whole needle value survives (default: niah_multikey_1, 2048 tokens, sample 0,
evaluation seed 0).

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/trimkv_needle_diagnostic.py [task] [tokens] [sample]
"""

from __future__ import annotations

import re
import sys

import torch

import kvsieve
from kvsieve.eval.tasks import get_task
from kvsieve.models.default_model import load_default_model


def main() -> None:
    torch.set_num_threads(1)
    model, tok = load_default_model()
    task, length, index = (sys.argv[1:] + ["niah_multikey_1", "2048", "0"][len(sys.argv) - 1:])[:3]
    sample = get_task(task).make_sample(tok, int(length), int(index), 0)
    ids = sample.prompt_ids

    def occurrences(numbers: set[str]) -> torch.Tensor:
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for number in numbers:
            for text in (" " + number, number):
                value = tok(text, add_special_tokens=False)["input_ids"]
                for i in range(len(ids) - len(value) + 1):
                    if ids[i : i + len(value)] == value:
                        mask[i : i + len(value)] = True
        return mask

    needle = occurrences(set(sample.references))
    distractor = occurrences(set(re.findall(r"\d{7}", tok.decode(ids))) - set(sample.references)) & ~needle
    print(task, length, index, "needle tokens", int(needle.sum()), "distractor-value tokens", int(distractor.sum()))
    caches = {
        "logbeta_dbtrimkv": kvsieve.KVCache(model, "dbtrimkv", budget=4096),
        "logbeta_trimkv": kvsieve.KVCache(model, "trimkv", budget=4096),
        "logbeta_dbtrimkv_untied": kvsieve.KVCache(model, "dbtrimkv_untied", budget=4096),
        "dbtrimkv@64": kvsieve.KVCache(model, "dbtrimkv", budget=64, schedule="prefill"),
        "dbtrimkv@256": kvsieve.KVCache(model, "dbtrimkv", budget=256, schedule="prefill"),
        "trimkv@256": kvsieve.KVCache(model, "trimkv", budget=256, schedule="prefill"),
        "dbtrimkv_untied@64": kvsieve.KVCache(model, "dbtrimkv_untied", budget=64, schedule="prefill"),
        "dbtrimkv_untied@256": kvsieve.KVCache(model, "dbtrimkv_untied", budget=256, schedule="prefill"),
        "snapkv@256": kvsieve.KVCache(model, "snapkv", budget=256),
    }
    with torch.inference_mode():
        kvsieve.prefill_shared(model, torch.tensor([ids]), list(caches.values()), logits_to_keep=1)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for name in ("logbeta_dbtrimkv", "logbeta_trimkv", "logbeta_dbtrimkv_untied"):
        stores = [caches[name].layers[layer].store for layer in range(layers)]
        lbs = torch.stack([store.dense().extras["log_beta"][0] for store in stores])  # (layers, heads, N)
        print(name, "mean log β: needle", float(lbs[:, :, needle].mean()), "other", float(lbs[:, :, ~needle].mean()),
              "last 40", float(lbs[:, :, -40:].mean()), "first 4", float(lbs[:, :, :4].mean()))
        top = lbs.mean(dim=(0, 1)).argsort(descending=True)[:20]
        print("  20 tokens with the highest mean β:", repr(tok.decode([ids[i] for i in sorted(top.tolist())])))
    for name in ("dbtrimkv@64", "dbtrimkv@256", "trimkv@256", "dbtrimkv_untied@64", "dbtrimkv_untied@256",
                 "snapkv@256"):
        cache = caches[name]
        kept = [cache.kept_positions(layer, 0, head) for layer in range(layers) for head in range(heads)]
        needle_kept = sum(int(needle[pos].sum()) for pos in kept)
        whole = sum(int(needle[pos].sum()) == int(needle.sum()) for pos in kept)
        distractor_kept = sum(int(distractor[pos].sum()) for pos in kept)
        recent_kept = sum(int((pos >= len(ids) - 40).sum()) for pos in kept)
        print(name, f"needle entries kept {needle_kept}/{int(needle.sum()) * layers * heads} (whole needle in "
              f"{whole}/{layers * heads} heads), distractor-value entries kept "
              f"{distractor_kept}/{int(distractor.sum()) * layers * heads},",
              f"last-40 entries kept {recent_kept}/{40 * layers * heads}")


if __name__ == "__main__":
    main()
