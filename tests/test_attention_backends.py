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


def test_context_form_is_off_inside_and_restores_after_an_error(cudnn_flag) -> None:
    """``cudnn_attention_off``: what kvsieve's timings wrap around whole forwards of the ``full`` (DynamicCache)
    rows on CUDA; nothing on a CPU."""
    from kvsieve.attention.backends import cudnn_attention_off

    torch.backends.cuda.enable_cudnn_sdp(True)
    with cudnn_attention_off(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError, match="forward failed"), cudnn_attention_off(torch.device("cuda")):
        raise RuntimeError("forward failed")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with cudnn_attention_off(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_bench_times_the_full_row_with_cudnn_off(monkeypatch) -> None:
    """``kvsieve bench``'s timed forwards run inside ``cudnn_attention_off`` (on a CPU it does nothing): recorded
    here by replacing it with a context that notes the device it was given."""
    import contextlib

    from kvsieve.bench import measure

    devices: list[torch.device] = []

    @contextlib.contextmanager
    def recording(device: torch.device):
        devices.append(device)
        yield

    monkeypatch.setattr(measure, "cudnn_attention_off", recording)
    model = build_model("llama")
    cache = measure.make_cache(model, measure.FULL, None)
    _, token = measure.timed_prefill(model, prompt(1, 12, seed=2), cache)
    measure.decode_latencies(model, cache, token, 2)
    assert [d.type for d in devices] == ["cpu", "cpu"]
