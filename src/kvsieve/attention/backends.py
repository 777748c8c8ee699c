"""Which of torch's fused attention kernels kvsieve's attention may use on a GPU: every one but cuDNN's.

torch's ``scaled_dot_product_attention`` prefers cuDNN's kernel on recent NVIDIA GPUs (torch 2.11 with CUDA 13 on an
H200: ``torch._fused_sdp_choice`` answers cuDNN for a bf16 decoding query), and cuDNN builds an execution plan for
every new shape it meets: measured on an H200 (two runs), the first call at a new key length took 45–47 ms without
a mask and 350–357 ms with one, against 0.04–0.2 ms for the flash and memory-efficient kernels, which need no plan, at
any length. A decoding step meets a new key length at every step, and a ragged cache one per layer (each layer's
longest head differs), so with cuDNN a step of ``adakv`` took 0.9–1.07 s and one of ``dbtrimkv`` 1.2–2.2 s, against
36–53 and 37–60 ms without (``benchmarks/results/cuda_plan_builds*.json``); transformers' own ``DynamicCache`` step
took 72–100 ms against 21–40 ms.

So while kvsieve attends over its cache on a CUDA device, cuDNN's kernel is switched off and torch chooses among the
others (flash where no mask is needed, else memory-efficient, else math), then switched back. The switch is
``torch.backends.cuda.enable_cudnn_sdp``, the public flag that ``torch.nn.attention.sdpa_kernel`` also sets (a layer's
switch off and on costs about 2 µs of host time; ``sdpa_kernel`` costs 26 µs per use). The
flag is process-wide, as ``sdpa_kernel``'s is: another thread's attention during the call would not use cuDNN either
(the same results within rounding). Nothing changes on a CPU, nor for a model used without a kvsieve cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

Result = TypeVar("Result")


def without_cudnn_attention(device: torch.device, run: Callable[[], Result]) -> Result:
    """``run()`` with cuDNN's SDPA kernel switched off on a CUDA ``device`` (and back on after, also when ``run``
    raises); on any other device, or when cuDNN's kernel is off already, ``run()`` as it is."""
    if device.type != "cuda":  # the path every CPU step takes: one comparison
        return run()
    with cudnn_attention_off(device):
        return run()


@contextmanager
def cudnn_attention_off(device: torch.device) -> Iterator[None]:
    """cuDNN's SDPA kernel off on a CUDA ``device`` for the block (back on after, also when it raises; left as it is
    when it was off already, and on any other device). :func:`without_cudnn_attention` uses it per layer; kvsieve's own
    timings and answers with transformers' ``DynamicCache`` (the ``full`` rows of ``kvsieve bench``, ``generate``,
    ``compress_context`` and ``kvsieve eval``) run whole forwards under it, so that a ``× full`` ratio compares caches,
    not attention kernels (with cuDNN's kernel a ``DynamicCache`` decoding step took 69–100 ms instead of 21–40 ms on
    an H200: a plan per new key length)."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        yield
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
