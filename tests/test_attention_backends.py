"""``without_cudnn_attention``: cuDNN's SDPA kernel off while kvsieve attends on a CUDA device, back on after."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import prompt

import kvsieve
from kvsieve.attention import forward
from kvsieve.attention.backends import without_cudnn_attention
from kvsieve.transformers_adapter import cache_kwargs


@pytest.fixture
def cudnn_flag():
    """The process-wide flag as the test found it, restored after (the tests set it)."""
    saved = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(saved)


def test_off_during_a_cuda_call_and_back_on_after(cudnn_flag) -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert without_cudnn_attention(torch.device("cuda"), torch.backends.cuda.cudnn_sdp_enabled) is False
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_back_on_when_the_call_raises(cudnn_flag) -> None:
    torch.backends.cuda.enable_cudnn_sdp(True)

    def failing() -> None:
        raise RuntimeError("attention failed")

    with pytest.raises(RuntimeError, match="attention failed"):
        without_cudnn_attention(torch.device("cuda"), failing)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_left_off_when_it_was_off_and_untouched_on_a_cpu(cudnn_flag) -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)
    assert without_cudnn_attention(torch.device("cuda"), torch.backends.cuda.cudnn_sdp_enabled) is False
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert without_cudnn_attention(torch.device("cpu"), torch.backends.cuda.cudnn_sdp_enabled) is True


def test_kvsieve_layers_attend_through_it_and_a_plain_model_does_not(monkeypatch) -> None:
    """The attention function wraps every kvsieve layer's attention (with the query's device) and nothing else."""
    devices: list[torch.device] = []

    def recording(device: torch.device, run):
        devices.append(device)
        return run()

    monkeypatch.setattr(forward, "without_cudnn_attention", recording)
    model = build_model("llama")
    ids = prompt(1, 24, seed=1)
    plain_logits = model(ids).logits
    assert not devices
    cache = kvsieve.KVCache(model, "snapkv", budget=32)  # above the prompt: nothing evicted
    logits = model(ids, **cache_kwargs(model, cache), use_cache=True).logits
    assert len(devices) == model.config.num_hidden_layers and all(d.type == "cpu" for d in devices)
    torch.testing.assert_close(logits, plain_logits)
