"""TrimKV / DBTrimKV: retention gates, their files, the inference policies, gated attention and training."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model
from helpers import prompt, random_gates
from transformers import DynamicCache

import kvsieve
from kvsieve.gates import B_OUT_INIT, GateConfig, GateMismatchError, RetentionGates, load_gates
from kvsieve.parts.scorers.retention import log_horizon, retention_score
from kvsieve.train import TrainConfig, capacity_loss, dense_gated_attention, gated_attention, train_gates
from kvsieve.train.student import GateContext, student_mode
from kvsieve.transformers_adapter import cache_kwargs

pytestmark = pytest.mark.compat  # runs in the transformers-version matrix (scripts/compat_matrix.sh)


def _gates(model: torch.nn.Module, tied: bool = True, spread: bool = True, seed: int = 0) -> RetentionGates:
    """Random gates; ``spread``: β well inside (0, 1) and varied, so rankings are non-trivial."""
    if spread:
        return random_gates(model, tied=tied, seed=seed)
    return RetentionGates(GateConfig.for_model(model, gate_hidden=8, tied=tied), seed=seed).requires_grad_(False)


# ---------------------------------------------------------------------------------------------- gates and files
def test_fresh_gate_is_almost_one():
    model = build_model("llama")
    gates = _gates(model, spread=False)
    assert gates.b_out.item() == B_OUT_INIT
    lb = gates.log_beta(0, torch.randn(2, 5, model.config.hidden_size))
    assert lb.shape == (2, model.config.num_key_value_heads, 5)
    assert bool((lb < 0).all()) and bool((lb > -1e-6).all())


@pytest.mark.parametrize("tied", [True, False])
def test_inference_gate_path_matches_training_path_and_follows_weight_updates(tied):
    """Without gradients the gates run flattened weights (one ``addmm`` for every head): the same log β as the
    per-head form autograd trains through (float32 rounding), for batch and token counts > 1, and an in-place
    update of the weights (an optimizer step, ``load_state_dict``) is seen by the next call (no stale copy)."""
    model = build_model("llama")
    gates = _gates(model, tied=tied).requires_grad_(True)
    x = torch.randn(3, 5, model.config.hidden_size)
    for layer in range(model.config.num_hidden_layers):
        with torch.enable_grad():
            trained = gates.log_beta(layer, x)
        assert trained.requires_grad
        with torch.no_grad():
            inferred = gates.log_beta(layer, x)
        assert inferred.shape == (3, model.config.num_key_value_heads, 5)
        torch.testing.assert_close(inferred, trained.detach(), rtol=0, atol=1e-6)
    with torch.no_grad():
        before = gates.log_beta(1, x)
        gates.w_in.mul_(-1.0)
        gates.b_in.add_(0.5)
        after = gates.log_beta(1, x)
    with torch.enable_grad():
        reference = gates.log_beta(1, x).detach()
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reference, rtol=0, atol=1e-6)
    with torch.inference_mode():  # gates made under inference mode (their tensors track no versions)
        frozen = _gates(model, tied=tied)
        inferred = frozen.log_beta(2, x)
    torch.testing.assert_close(inferred, _gates(model, tied=tied).requires_grad_(True).log_beta(2, x).detach(),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip_bit_exact(tmp_path, tied):
    model = build_model("llama")
    gates = _gates(model, tied=tied)
    gates.save(tmp_path / "g")
    loaded = load_gates(tmp_path / "g", model)
    assert loaded.config == gates.config
    for (name, a), (_, b) in zip(gates.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    x = torch.randn(1, 7, model.config.hidden_size)
    assert torch.equal(gates.log_beta(1, x), loaded.log_beta(1, x))
    assert not any(p.requires_grad for p in loaded.parameters())


def test_gates_object_on_another_device_is_copied_to_the_models():
    """Gates built on one device for a model on another (a CPU-built gate, a GPU model): ``on(device)`` (what a
    cache binds) is a frozen copy there, equal in value, and the caller's object stays where it was. The copy goes
    to the ``meta`` device here (no GPU in CI; tests/test_cuda.py runs the real case through ``KVCache``)."""
    model = build_model("llama")
    gates = _gates(model, tied=True)
    assert gates.on(torch.device("cpu")) is gates
    moved = gates.on(torch.device("meta"))
    assert moved is not gates and moved.config == gates.config and moved.w_in.device.type == "meta"
    assert not any(p.requires_grad for p in moved.parameters())
    assert gates.w_in.device.type == "cpu"
    back = moved.to_empty(device="cpu")
    back.load_state_dict(gates.state_dict())  # shapes match the original's exactly
    assert torch.equal(back.log_beta(1, torch.ones(1, 3, model.config.hidden_size)),
                       gates.log_beta(1, torch.ones(1, 3, model.config.hidden_size)))


def test_load_refuses_mismatched_model(tmp_path):
    _gates(build_model("llama")).save(tmp_path / "g")
    with pytest.raises(GateMismatchError, match="model_type='qwen2'"):
        load_gates(tmp_path / "g", build_model("qwen2"))
    with pytest.raises(GateMismatchError, match="model_type"):
        kvsieve.KVCache(build_model("qwen2"), "dbtrimkv", budget=8, gates=str(tmp_path / "g"))


def test_load_refuses_tampered_shapes(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_model("llama")
    _gates(model).save(tmp_path / "g")
    tensors = load_file(str(tmp_path / "g.safetensors"))
    tensors["w_in"] = tensors["w_in"][:, :, :, :4].contiguous()
    save_file(tensors, str(tmp_path / "g.safetensors"))
    with pytest.raises(GateMismatchError, match="do not match"):
        load_gates(tmp_path / "g", model)


def test_missing_pretrained_gates_say_how_to_train():
    model = build_model("qwen3")
    model.config._name_or_path = "/models/my-qwen3"
    before = model.config._attn_implementation
    with pytest.raises(FileNotFoundError, match=r"kvsieve train --model /models/my-qwen3 --variant dbtrimkv"):
        kvsieve.KVCache(model, "dbtrimkv", budget=8)
    assert model.config._attn_implementation == before  # refused before the model was touched


def test_bad_parameters_refused_before_touching_model():
    model = build_model("llama")
    before = model.config._attn_implementation
    for kwargs in ({"lookahead": 0}, {"window": -1}, {"pretrained": "nope"}, {"gates": 3}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            kvsieve.KVCache(model, "dbtrimkv", budget=8, **kwargs)
    assert model.config._attn_implementation == before


# ---------------------------------------------------------------------------------------------- score
def test_score_hand_computed():
    lb = torch.tensor([math.log(0.5), math.log(0.9)])
    age = torch.tensor([2.0, 0.0])
    # n = 1: (t + 1 − i)·log β
    assert torch.allclose(retention_score(lb, age, 1), torch.tensor([3 * math.log(0.5), math.log(0.9)]))
    # n = 3: log(β^{a+1} + β^{a+2} + β^{a+3})
    expected = torch.tensor([math.log(0.5**3 + 0.5**4 + 0.5**5), math.log(0.9 + 0.81 + 0.729)])
    assert torch.allclose(retention_score(lb, age, 3), expected, atol=1e-6)
    # β → 1: the horizon term tends to log n, finitely
    tiny = torch.tensor([-1.5e-8, 0.0])
    assert torch.allclose(log_horizon(tiny, 32), torch.full((2,), math.log(32)), atol=1e-5)


def test_capacity_loss_hand_computed():
    # one layer, two heads, three queries: masses per (head, t)
    masses = [torch.tensor([[[1.0, 2.0, 5.0], [1.0, 1.5, 1.0]]])]
    # per head, M = 2: overflow (0, 0, 3) and (0, 0, 0) → mean 3/6, divided by M
    assert capacity_loss(masses, 2, "head").item() == pytest.approx(3 / 6 / 2)
    # global, M = 2 → total budget 4: sums (2, 3.5, 6) → overflow (0, 0, 2) → mean 2/3, divided by 4
    assert capacity_loss(masses, 2, "global").item() == pytest.approx(2 / 3 / 4)
    with pytest.raises(ValueError, match="scope"):
        capacity_loss(masses, 2, "layer")


# ---------------------------------------------------------------------------------------------- inference
@pytest.mark.parametrize("policy", ["trimkv", "dbtrimkv"])
def test_fresh_gates_with_budget_covering_everything_equal_full_cache(policy):
    model, ref = build_model("llama"), build_model("llama")
    ids = prompt(batch=2, length=20)
    cache = kvsieve.KVCache(model, policy, budget=64, gates=_gates(model, spread=False))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, **cache_kwargs(model, cache), output_logits=True,
                         return_dict_in_generate=True)
    full = ref.generate(ids, max_new_tokens=8, do_sample=False, **cache_kwargs(ref, DynamicCache()),
                        output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, full.sequences)
    for a, b in zip(out.logits, full.logits, strict=True):
        assert torch.equal(a, b)


def test_dbtrimkv_holds_exactly_the_global_budget_ragged_every_step():
    model = build_model("llama")
    budget, layers, heads = 12, model.config.num_hidden_layers, model.config.num_key_value_heads
    ids = prompt(batch=2, length=40, seed=3)
    cache = kvsieve.KVCache(model, "dbtrimkv", budget=budget, buffer=0, window=2, gates=_gates(model))
    out = model(ids, **cache_kwargs(model, cache))
    token = out.logits[:, -1:].argmax(-1)
    seen_ragged = False
    for _ in range(10):
        out = model(token, **cache_kwargs(model, cache))
        token = out.logits[:, -1:].argmax(-1)
        lengths = cache.head_lengths()  # (layers, batch, heads)
        assert lengths.sum(dim=(0, 2)).tolist() == [layers * heads * budget] * 2
        assert int(lengths.min()) >= 2  # the protected window
        seen_ragged |= bool((lengths != lengths[0, 0, 0]).any())
        for layer in range(layers):  # positions stay sorted and unique
            pos = cache.kept_positions(layer, 1, 0)
            assert bool((pos[1:] > pos[:-1]).all())
    assert seen_ragged


def test_trimkv_holds_budget_per_head_and_keeps_the_highest_scores():
    model = build_model("llama")
    gates = _gates(model, tied=False)
    ids = prompt(batch=1, length=30, seed=5)
    cache = kvsieve.KVCache(model, "trimkv", budget=10, window=0, lookahead=1, gates=gates)
    model(ids, **cache_kwargs(model, cache))
    model(ids[:, -1:] * 0 + 7, **cache_kwargs(model, cache))  # the prompt's compaction is applied here, then 1 more
    cache.flush()
    assert cache.head_lengths().max() <= 10 + 16
    # the prompt compaction kept, per head, the top-10 log β·(t + 1 − i) of the 30 prompt tokens
    with torch.no_grad():
        hidden = {}

        def grab(module, args, kwargs):
            hidden[module.layer_idx] = kwargs["hidden_states"]

        handles = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
        model(ids, **cache_kwargs(model, DynamicCache()))
        for handle in handles:
            handle.remove()
    for layer in range(model.config.num_hidden_layers):
        lb = gates.log_beta(layer, hidden[layer])[0]  # (heads, 30)
        score = retention_score(lb, 29 - torch.arange(30.0), 1)
        for head in range(lb.shape[0]):
            kept = cache.kept_positions(layer, 0, head)
            prompt_kept = kept[kept < 30]
            assert set(prompt_kept.tolist()) <= set(score[head].topk(10).indices.tolist())


def test_dbtrimkv_batch_rows_are_independent():
    model = build_model("llama")
    gates = _gates(model)
    a, b = prompt(1, 30, seed=1), prompt(1, 30, seed=2)
    both = kvsieve.KVCache(model, "dbtrimkv", budget=8, window=1, gates=gates)
    model(torch.cat([a, b]), **cache_kwargs(model, both))
    alone = kvsieve.KVCache(model, "dbtrimkv", budget=8, window=1, gates=gates)
    model(b, **cache_kwargs(model, alone))
    for layer in range(model.config.num_hidden_layers):
        for head in range(model.config.num_key_value_heads):
            assert torch.equal(both.kept_positions(layer, 1, head), alone.kept_positions(layer, 0, head))


# ---------------------------------------------------------------------------------------------- training
def test_gated_attention_with_beta_one_is_plain_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 33, 8, generator=gen) for h in (4, 2, 2))
    out, mass = gated_attention(q, k, v, torch.zeros(2, 2, 33), 0.35, block_size=7)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True, scale=0.35)
    assert torch.allclose(out, ref, atol=1e-6)
    assert torch.equal(mass, torch.arange(1.0, 34.0).expand(2, 2, 33))  # Σ_{i≤t} 1 = t + 1


@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_blockwise_gated_attention_equals_dense_reference_with_gradients(block):
    gen = torch.Generator().manual_seed(block)
    q, k, v = (torch.randn(1, h, 29, 8, generator=gen) for h in (6, 2, 2))
    lb = (-torch.rand(1, 2, 29, generator=gen)).requires_grad_(True)
    with torch.enable_grad():
        out, mass = gated_attention(q, k, v, lb, 0.3, block_size=block)
        ref = dense_gated_attention(q, k, v, lb, 0.3)
        assert torch.allclose(out, ref, atol=1e-6)
        (grad,) = torch.autograd.grad((out * torch.arange(8.0)).sum(), lb)
        (grad_ref,) = torch.autograd.grad((ref * torch.arange(8.0)).sum(), lb)
    assert torch.allclose(grad, grad_ref, atol=1e-5)
    t = torch.arange(29.0)
    age = (t[:, None] - t[None, :]).clamp(min=0)
    expected = ((age * lb.detach()[0, :, None, :]).exp() * (age[None] >= 0) * (t[:, None] >= t[None, :])).sum(-1)
    assert torch.allclose(mass[0], expected, atol=1e-5)


def test_student_with_fresh_gates_matches_teacher_and_only_gates_get_gradients():
    model = build_model("llama")
    model.requires_grad_(False)
    gates = RetentionGates(GateConfig.for_model(model, gate_hidden=8, tied=True))
    ids = prompt(1, 24)
    with torch.enable_grad():
        teacher = model(ids).logits
        with student_mode(model):
            ctx = GateContext(gates, block_size=5)
            student = model(ids, gate_context=ctx).logits
        assert torch.allclose(student, teacher, atol=1e-4)  # β ≈ 1 − 1.5e-8
        masses = [ctx.masses[i] for i in sorted(ctx.masses)]
        (student.logsumexp(-1).sum() + capacity_loss(masses, 4, "global")).backward()
    assert model.config._attn_implementation == "sdpa"  # restored
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in gates.parameters())


def test_train_is_deterministic_and_resumes(tmp_path):
    from kvsieve.models.tiny import load_tiny_llama

    model, tokenizer = load_tiny_llama()
    before = {name: (p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()}
    config = TrainConfig(variant="trimkv", budget=16, steps=2, lengths=(512,), kl_tokens=16, heldout=1,
                         eval_every=1, save_every=1, gate_hidden=4, lr=1e-2, block_size=64)
    with torch.enable_grad():
        straight = train_gates(model, tokenizer, config, output_dir=tmp_path / "a", progress=False)
        train_gates(model, tokenizer, TrainConfig(**{**config.__dict__, "steps": 1}), output_dir=tmp_path / "b",
                    progress=False)
        resumed = train_gates(model, tokenizer, config, output_dir=tmp_path / "b", progress=False)
    for name, tensor in straight.gates.state_dict().items():
        assert torch.equal(tensor, resumed.gates.state_dict()[name]), name
    assert straight.gates.b_out.detach().max() < B_OUT_INIT  # it moved
    assert [h["kl"] for h in straight.history] == [h["kl"] for h in resumed.history]
    loaded = load_gates(tmp_path / "a" / "gates", model)
    assert loaded.config.training["steps"] == 2 and not loaded.config.tied
    for name, p in model.named_parameters():  # the model is frozen during training and left as it was
        assert torch.equal(p, before[name][0]) and p.requires_grad == before[name][1], name


def test_shared_prefill_feeds_layer_inputs_to_followers_of_a_full_lead():
    model = build_model("llama")
    gates = _gates(model)
    ids = prompt(2, 30, seed=4)
    lead = kvsieve.KVCache(model, "full")
    followers = [kvsieve.KVCache(model, p, budget=6, window=1, gates=gates) for p in ("dbtrimkv", "trimkv")]
    kvsieve.prefill_shared(model, ids, [lead, *followers])
    for policy, shared in zip(("dbtrimkv", "trimkv"), followers, strict=True):
        alone = kvsieve.KVCache(model, policy, budget=6, window=1, gates=gates)
        model(ids, **cache_kwargs(model, alone))
        assert torch.equal(shared.head_lengths(), alone.head_lengths())
        for layer in range(model.config.num_hidden_layers):
            assert torch.equal(shared.kept_positions(layer, 1, 1), alone.kept_positions(layer, 1, 1))


def test_shipped_gates_describe_the_default_model():
    from kvsieve.gates.pretrained import PRETRAINED_DIR
    from kvsieve.gates.retention import read_config

    shipped = sorted(PRETRAINED_DIR.glob("smollm2-135m-instruct-*.json"))
    assert shipped, "the default model's gates must ship with the package"
    for meta in shipped:
        config = read_config(meta)
        assert (config.model_type, config.num_layers, config.num_kv_heads, config.hidden_size) == ("llama", 30, 3, 576)
        assert config.tied == meta.stem.endswith("-dbtrimkv")
        assert config.training["steps"] > 0 and "heldout" in config.training
        assert meta.with_suffix(".safetensors").is_file()


@pytest.mark.parametrize("variant", ["trimkv", "dbtrimkv", "dbtrimkv_untied"])
def test_shipped_gates_are_not_handed_to_another_model_of_the_same_shapes(variant):
    """Shipped gates are matched by the weights' fingerprint: a random Llama with SmolLM2-135M's shapes,
    even loaded from a folder of the right name, does not get them (it used to). The real model gets them
    under any folder name (``test_real_model.py``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsieve.gates.pretrained import pretrained_stem

    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=64, vocab_size=256)
    stand_in = LlamaForCausalLM(config)
    stand_in.config._name_or_path = "/home/user/.cache/kvsieve/smollm2-135m-instruct"
    with pytest.raises(FileNotFoundError, match=r"weights sha256:[0-9a-f]{16}.*fingerprint"):
        pretrained_stem(stand_in, variant)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: {**raw, "surprise": 1}, "unknown keys"),
        (lambda raw: [raw], "holds a list"),
        (lambda raw: {**raw, "gate_hidden": "32"}, "gate_hidden must be an int"),
        (lambda raw: {**raw, "tied": "yes"}, "tied must be a bool"),
    ],
)
def test_a_malformed_gate_config_names_the_file_and_field(tmp_path, edit, message):
    import json

    model = build_model("llama")
    _gates(model).save(tmp_path / "g")
    meta = tmp_path / "g.json"
    meta.write_text(json.dumps(edit(json.loads(meta.read_text()))))
    with pytest.raises(GateMismatchError, match=message):
        load_gates(tmp_path / "g", model)
    with pytest.raises(GateMismatchError, match=message):  # and before the model is touched
        kvsieve.KVCache(model, "dbtrimkv", budget=8, gates=str(tmp_path / "g"))


def test_truncated_or_non_finite_gate_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_model("llama")
    _gates(model).save(tmp_path / "g")
    weights = tmp_path / "g.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(GateMismatchError, match="not a readable safetensors file"):
        load_gates(tmp_path / "g", model)
    _gates(model).save(tmp_path / "g")
    tensors = load_file(str(weights))
    tensors["b_out"] = torch.tensor(float("nan"))
    save_file(tensors, str(weights))
    with pytest.raises(GateMismatchError, match="b_out hold NaN"):
        load_gates(tmp_path / "g", model)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_train_refuses_a_non_finite_capacity_weight(value):
    with pytest.raises(ValueError, match="capacity_weight must be a finite number"):
        TrainConfig(capacity_weight=value)


def test_train_does_not_resume_another_models_checkpoint(tmp_path):
    """Same shapes, other weights: the checkpoint records the model's fingerprint (it used to resume)."""
    from kvsieve.models.tiny import load_tiny_llama

    model, tokenizer = load_tiny_llama()
    other, _ = load_tiny_llama()
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    config = TrainConfig(variant="trimkv", budget=16, steps=1, lengths=(512,), kl_tokens=8, heldout=0,
                         save_every=1, gate_hidden=4, block_size=64)
    with torch.enable_grad():
        train_gates(model, tokenizer, config, output_dir=tmp_path, progress=False)
        with pytest.raises(ValueError, match="written for another model"):
            train_gates(other, tokenizer, TrainConfig(**{**config.__dict__, "steps": 2}), output_dir=tmp_path,
                        progress=False)
    (tmp_path / "checkpoint.safetensors").write_bytes(b"\x00" * 10)
    with torch.enable_grad(), pytest.raises(ValueError, match=r"cannot be read.*--no-resume"):
        train_gates(model, tokenizer, TrainConfig(**{**config.__dict__, "steps": 2}), output_dir=tmp_path,
                    progress=False)


def test_train_refuses_lengths_its_tasks_cannot_fill(capsys):
    """``--lengths 256`` used to fail at step 4 (the first ``vt`` sample), after the model loaded."""
    from kvsieve.cli import main
    from kvsieve.train.data import min_training_length

    with pytest.raises(ValueError, match=rf"lengths must be ints ≥ {min_training_length()}"):
        TrainConfig(lengths=(256,))
    assert main(["train", "--model", "tiny-llama", "--lengths", "256", "--output", "/nonexistent/x"]) == 2
    assert "lengths must be ints" in capsys.readouterr().err
