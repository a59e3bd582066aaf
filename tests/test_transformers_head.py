"""``lowp_ops.integrations.transformers.apply_lowp_ops``'s LM head and loss on tiny random transformers
models (no downloads): the patched model's loss and every parameter's gradient equal the unpatched
model's (fp32: tight), with images, tuples, wrappers, Trainer columns, mixed precision, gradient
accumulation, logits on request, generate, save / load; the logit steps (soft-capping, scales)
switched off and back; one compiled graph; bad arguments and replaced forwards refused."""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import pickle
import subprocess
import sys
import threading

import pytest
import torch

pytest.importorskip(
    "transformers", minversion="5", reason="needs transformers>=5,<6 (pip install 'lowp_ops[transformers]')"
)
from torch._dynamo.utils import counters
from transformers import default_data_collator
from transformers.trainer_utils import RemoveColumnsCollator
from transformers_models import (
    IMAGE_TESTED,
    VISION_LANGUAGE,
    VOCAB,
    ForwardingWrapper,
    PeftLikeWrapper,
    assert_same_training_signal,
    batch,
    fp32_rtol,
    image_batch,
    loss_and_grads,
    tiny_model,
)

from lowp_ops.integrations.transformers import LM_HEAD_MODEL_TYPES, apply_lowp_ops
from lowp_ops.integrations.transformers import head as lowp_head
from lowp_ops.integrations.transformers import layers as lowp_layers
from lowp_ops.integrations.transformers.binding import bound_function

# ----------------------------------------------------------------------------------- LM head + loss


@pytest.mark.parametrize("model_type", sorted(LM_HEAD_MODEL_TYPES))
def test_loss_and_gradients_equal_the_models_own_fp32(model_type):
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    assert_same_training_signal(ref, patched, *batch(), rtol=fp32_rtol(model_type))


@pytest.mark.parametrize("model_type", sorted(IMAGE_TESTED))
def test_vision_language_models_with_images(model_type):
    """Images through the vision tower (some of whose norms are patched too: Qwen2.5-VL's are Llama's)
    into the language model: the patched model's loss and gradients are the unpatched one's."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels, images = image_batch(model_type)
    assert_same_training_signal(ref, patched, ids, labels, rtol=fp32_rtol(model_type), **images)


@pytest.mark.parametrize("model_type", sorted(set(VISION_LANGUAGE) - IMAGE_TESTED))
def test_untested_vision_towers_are_left_alone(model_type):
    model = apply_lowp_ops(tiny_model(model_type))
    language_model = model.get_decoder()
    inside = {id(module) for module in language_model.modules()}
    patched = [name for name, m in model.named_modules() if "forward" in vars(m) and id(m) not in inside]
    assert sorted(patched) == ["", "lm_head"]


def test_tied_embeddings_router_aux_loss_and_mxfp8_gradient():
    ref = tiny_model("mixtral", tie_word_embeddings=True, output_router_logits=True)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    assert_same_training_signal(ref, patched, *batch(), rtol=2e-6)
    mxfp8 = apply_lowp_ops(copy.deepcopy(ref), grad_format="mxfp8_e4m3")
    assert_same_training_signal(ref, mxfp8, *batch(), rtol=0.1)  # E4M3 logits gradient


@pytest.mark.parametrize("labels_given", [True, False])
def test_tuple_output_keeps_the_models_positions(labels_given):
    """``return_dict=False``: the model's own tuple drops None fields; the patched one keeps the logits'
    slot (None when training with labels) so that every later field stays where it was."""
    ref = tiny_model("qwen3_moe", output_router_logits=True)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = batch()
    kwargs = {"labels": labels} if labels_given else {}
    want = ref(input_ids=ids, return_dict=False, **kwargs)
    got = patched(input_ids=ids, return_dict=False, **kwargs)
    assert len(got) == len(want)
    # (loss, aux_loss, logits, past_key_values, router_logits); no loss without labels
    logits_at = 2 if labels_given else 1
    assert want[logits_at].shape == (*ids.shape, VOCAB)
    if labels_given:
        assert got[logits_at] is None
        torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=0)
    else:
        torch.testing.assert_close(got[logits_at], want[logits_at], rtol=2e-6, atol=2e-6)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        if index != logits_at:
            assert type(mine) is type(theirs), index


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma2"])
def test_a_whole_patched_model_saves_and_loads(model_type, tmp_path):
    """torch.save / pickle of the whole patched model loads back patched, with the same loss (bound
    methods pickled as getattr(module, name), which the modules do not have)."""
    options = {"experts": "bf16"} if model_type == "qwen3_moe" else {}
    dtype = torch.bfloat16 if options else torch.float32
    model = apply_lowp_ops(tiny_model(model_type, dtype=dtype), **options)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    ids, labels = batch()
    assert torch.equal(loaded(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss)
    assert bound_function(loaded.lm_head.forward) is lowp_head._hidden_passthrough
    assert inspect.signature(loaded.forward) == inspect.signature(model.forward)


LOAD_IN_A_FRESH_PROCESS = """
import inspect, sys, torch
from lowp_ops.integrations.transformers.binding import bound_function
model = torch.load(sys.argv[1], weights_only=False)
ids, labels = torch.load(sys.argv[2])
patched = [bound_function(module.forward) for module in model.modules() if "forward" in vars(module)]
print(float(model(input_ids=ids, labels=labels).loss))
print(len(patched), sum(function is None for function in patched))
print(list(inspect.signature(model.forward).parameters))
"""


def test_a_saved_patched_model_loads_patched_in_a_fresh_process(tmp_path):
    """Loading needs no earlier apply_lowp_ops in the loading process: the forwards come back bound to
    lowp's functions (pickled by reference), with the loss and the forward's signature of the saved model."""
    model = apply_lowp_ops(tiny_model("gemma2"), rms_norm=True)
    ids, labels = batch()
    torch.save(model, tmp_path / "model.pt")
    torch.save((ids, labels), tmp_path / "batch.pt")
    paths = [str(tmp_path / "model.pt"), str(tmp_path / "batch.pt")]
    run = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, *paths], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    loss, counts, names = run.stdout.splitlines()[-3:]
    assert float(loss) == float(model(input_ids=ids, labels=labels).loss)
    patched = [module for module in model.modules() if "forward" in vars(module)]
    assert counts == f"{len(patched)} 0" and len(patched) > 3
    assert names == str(list(inspect.signature(model.forward).parameters))


def test_copies_run_their_own_modules_and_other_methods_pickle_as_before():
    """copy.deepcopy of a patched model binds each patched forward to the copy's module (training the
    copy leaves the original alone); bound methods that are not lowp's pickle as Python's own reducer
    does (``getattr(obj, name)``) once lowp's reducer is registered."""
    model = apply_lowp_ops(tiny_model("llama"), rms_norm=True)
    twin = copy.deepcopy(model)
    pairs = [(a, b) for a, b in zip(model.modules(), twin.modules(), strict=True) if "forward" in vars(a)]
    assert len(pairs) > 3
    assert all(vars(b)["forward"].__self__ is b and bound_function(vars(b)["forward"]) for _, b in pairs)
    ids, labels = batch()
    twin(input_ids=ids, labels=labels).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    counter = collections.Counter("abca")
    assert pickle.loads(pickle.dumps(counter.most_common))() == counter.most_common()


@pytest.mark.parametrize(
    ("model_type", "options"), [("llama", {}), ("gemma2", {}), ("qwen3_moe", {"experts": "bf16"})]
)
def test_mixed_precision_computes_as_the_models_own_autocast(model_type, options, monkeypatch):
    """fp32 weights under ``torch.autocast(bfloat16)`` (transformers' Trainer with ``bf16=True``): the
    patched LM head, dense MLPs and experts take bf16 operands where the model's linear layers would
    (the ops themselves never autocast), and the fp32 weights get fp32 gradients; loss and gradients
    as close to the model's own autocast step as two bf16 computations are (measured: at most 8.3e-3)."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref), **options)
    dtypes = []
    loss_of = lowp_head.linear_cross_entropy
    monkeypatch.setattr(
        lowp_head,
        "linear_cross_entropy",
        lambda h, w, *a, **k: dtypes.append((h.dtype, w.dtype)) or loss_of(h, w, *a, **k),
    )
    ids, labels = batch()
    results = []
    for model in (ref, patched):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    assert dtypes == [(torch.bfloat16, torch.bfloat16)]
    (want_loss, want), (got_loss, got) = results
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-3, atol=0)
    assert got.keys() == want.keys() and all(g.dtype == torch.float32 for g in got.values())
    for name, grad in want.items():
        error = (got[name].double() - grad.double()).norm() / grad.double().norm().clamp(min=1e-30)
        assert error <= 2e-2, f"{name}: gradient off by {float(error):.2e} of its norm"


def test_wrapped_models_have_their_transformers_model_patched():
    """A PEFT-style wrapper (``get_base_model``) or a ``torch.compile``'d model: the model inside is
    patched, the wrapper returned; a wrapper that only forwards attributes is refused (patching it
    would leave the inner forward's loss unpatched, fed the hidden states)."""
    ref = tiny_model("llama")
    ids, labels = batch()
    want = ref(input_ids=ids, labels=labels).loss
    for wrap in (PeftLikeWrapper, functools.partial(torch.compile, backend="eager")):
        inner = copy.deepcopy(ref)
        wrapped = wrap(inner)
        assert apply_lowp_ops(wrapped) is wrapped
        assert bound_function(inner.lm_head.forward) is lowp_head._hidden_passthrough
        torch.testing.assert_close(wrapped(input_ids=ids, labels=labels).loss, want, rtol=2e-6, atol=0)
    forwarding = ForwardingWrapper(copy.deepcopy(ref))
    with pytest.raises(ValueError, match=r"ForwardingWrapper has no lm_head child module"):
        apply_lowp_ops(forwarding)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_trainer_keeps_the_batch_columns_the_forward_names(model_type):
    """transformers' Trainer hands a batch only the columns ``inspect.signature(model.forward)`` names
    (``RemoveColumnsCollator``): the patched forward names the class's parameters (a bare ``**kwargs``
    dropped ``input_ids`` and ``labels``) and ``return_logits``."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref))
    names = list(inspect.signature(patched.forward).parameters)
    want = [name for name in inspect.signature(type(ref).forward).parameters if name != "self"]
    assert [name for name in names if name != "return_logits"] == want and "return_logits" in names
    collate = RemoveColumnsCollator(default_data_collator, names)
    ids, labels = batch()
    columns = collate([{"input_ids": i, "labels": t, "text": "-"} for i, t in zip(ids, labels, strict=True)])
    assert set(columns) == {"input_ids", "labels"}
    torch.testing.assert_close(patched(**columns).loss, ref(**columns).loss, rtol=5e-6, atol=0)


def test_forwards_replaced_by_other_libraries_are_refused():
    """accelerate's device hooks (after ``device_map`` dispatch) and other patchers replace ``forward`` on
    the instance; lowp's patch would drop them: refused, naming the module, the model left as it was.
    Patching twice is fine (the forwards are lowp's own)."""
    for path in ("lm_head", "model.layers.1.post_attention_layernorm", "model.layers.0.mlp"):
        model = tiny_model("llama")
        module = model.get_submodule(path)
        module.forward = functools.partial(type(module).forward, module)
        with pytest.raises(ValueError, match=rf"{path}\.forward was replaced on the instance"):
            apply_lowp_ops(model)
        assert "forward" not in vars(model) and "forward" not in vars(model.model.norm)
    twice = apply_lowp_ops(apply_lowp_ops(tiny_model("llama")))
    ref = tiny_model("llama")
    ids, labels = batch()
    want = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(twice(input_ids=ids, labels=labels).loss, want, rtol=5e-6, atol=0)


def test_experts_converted_after_patching_are_named():
    model = apply_lowp_ops(tiny_model("qwen3_moe", dtype=torch.bfloat16), experts="bf16").float()
    with pytest.raises(ValueError, match=r"apply_lowp_ops\(experts='bf16'\): .* are torch.float32;"):
        model(input_ids=batch()[0])


def test_head_replaced_after_patching_is_named():
    """resize_token_embeddings replaces lm_head: the patched forward says so instead of feeding logits
    to the loss as hidden states."""
    model = apply_lowp_ops(tiny_model("llama"))
    model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    ids, labels = batch()
    for kwargs in ({"labels": labels}, {}):
        with pytest.raises(RuntimeError, match="lm_head was replaced after apply_lowp_ops"):
            model(input_ids=ids, **kwargs)


def test_a_loss_other_than_the_causal_lm_loss_is_refused_or_named():
    """A loss set on the model before patching (``loss_function``, or a ``loss_type`` of another loss)
    would be replaced by the patch's causal-LM loss: refused, the model untouched; one set after
    patching would be fed hidden states: the patched forward says so."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    ids, labels = batch()

    def doubled(logits, labels, vocab_size, **kwargs):
        return 2 * ForCausalLMLoss(logits, labels, vocab_size, **kwargs)

    model = tiny_model("llama")
    model.loss_function = doubled
    with pytest.raises(ValueError, match=r"model\.loss_function was set to"):
        apply_lowp_ops(model)
    assert model.forward.__func__ is type(model).forward  # left untouched
    model = tiny_model("llama")
    model.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match=r"model\.loss_type 'ForMaskedLM' selects ForMaskedLMLoss"):
        apply_lowp_ops(model)
    explicit = tiny_model("llama")
    explicit.loss_function = ForCausalLMLoss  # the causal-LM loss itself, set explicitly: patched
    want = explicit(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(
        apply_lowp_ops(explicit)(input_ids=ids, labels=labels).loss, want, rtol=2e-6, atol=0
    )
    patched = apply_lowp_ops(tiny_model("llama"))
    patched.loss_function = doubled
    with pytest.raises(RuntimeError, match="loss_function was replaced after apply_lowp_ops"):
        patched(input_ids=ids, labels=labels)
    assert patched(input_ids=ids).logits.shape[-1] == VOCAB  # no labels, no loss: logits as before


def test_wrappers_and_float64_are_named():
    """A DDP-style ``.module`` wrapper, a head that is not a plain ``nn.Linear`` (an adapter's), and a
    model converted to float64 after patching: errors that say what to do."""

    class ModuleWrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(ValueError, match=r"holding one in `\.module`"):
        apply_lowp_ops(ModuleWrapper(tiny_model("llama")))

    class AdaptedLinear(torch.nn.Linear):
        pass

    model = tiny_model("llama")
    head = model.lm_head
    model.lm_head = AdaptedLinear(head.in_features, head.out_features, bias=False)
    with pytest.raises(ValueError, match=r"got test_transformers_head\..*AdaptedLinear .*not supported"):
        apply_lowp_ops(model)
    model = apply_lowp_ops(tiny_model("llama")).double()
    ids, labels = batch()
    with pytest.raises(TypeError, match="the model is float64"):
        model(input_ids=ids, labels=labels)


def test_gradient_accumulation_with_num_items_in_batch():
    """Two micro-batches, each loss summed and divided by the valid labels of both: the accumulated
    gradient equals the unpatched model's, and the summed loss equals the mean over the full batch."""
    ref = tiny_model("llama")
    patched = apply_lowp_ops(copy.deepcopy(ref))
    micro = [batch(seed=1, ignored=5), batch(seed=2, ignored=1)]
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
    losses = {}
    for model in (ref, patched):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for ids, labels in micro:
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(num_items)).loss
            loss.backward()
            total += loss.detach()
        losses[model] = total
    full_ids = torch.cat([ids for ids, _ in micro])
    full_labels = torch.cat([labels for _, labels in micro])
    full_mean = ref(input_ids=full_ids, labels=full_labels).loss.detach()
    torch.testing.assert_close(losses[patched], full_mean, rtol=2e-6, atol=0)
    torch.testing.assert_close(losses[patched], losses[ref], rtol=2e-6, atol=0)
    for (name, want), got in zip(ref.named_parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_shift_labels_are_used_as_given():
    ref = tiny_model("qwen3")
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    assert_same_training_signal(ref, patched, ids, labels, rtol=2e-6, shift_labels=shifted)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "granite", "cohere"])
def test_logits_only_when_asked_or_without_labels(model_type):
    """The head's own logits, bit for bit (norms and MLPs left alone: they round in another order), its
    logit step (soft-capping, scales) included."""
    ref = tiny_model(model_type)
    patched = apply_lowp_ops(copy.deepcopy(ref), rms_norm=False, mlp=False)
    ids, labels = batch()
    assert patched(input_ids=ids, labels=labels).logits is None
    want = ref(input_ids=ids).logits
    torch.testing.assert_close(patched(input_ids=ids).logits, want, rtol=0, atol=0)
    out = patched(input_ids=ids, labels=labels, return_logits=True)
    torch.testing.assert_close(out.logits, want, rtol=0, atol=0)
    assert out["logits"] is out.logits
    last = patched(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(last, ref(input_ids=ids, logits_to_keep=1).logits, rtol=0, atol=0)
    assert last.shape == (2, 1, VOCAB)
    patched.eval()
    loss, logits, *_ = patched(input_ids=ids, labels=labels, return_dict=False)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=labels).loss, rtol=2e-6, atol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_generate_uses_the_patched_head(model_type):
    ref = tiny_model(model_type).eval()
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, _ = batch()
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(ids, **options), ref.generate(ids, **options))


# ----------------------------------------------------------------- logit steps (Gemma, Granite, Cohere)


def logit_step_value(model):
    transform = lowp_head.LOGIT_TRANSFORMS[model.config.model_type]
    return getattr(transform.holder(model), transform.name)


@pytest.mark.parametrize("model_type", sorted(lowp_head.LOGIT_TRANSFORMS))
def test_logit_step_is_back_after_each_forward(model_type):
    """The class forward runs with the step switched off; afterwards, an exception included, the model
    has its own value again (so save_pretrained and the unpatched class see it)."""
    model = apply_lowp_ops(tiny_model(model_type))
    value = logit_step_value(model)
    ids, labels = batch()
    model(input_ids=ids, labels=labels).loss.backward()
    assert logit_step_value(model) == value
    with pytest.raises(IndexError):
        model(input_ids=ids + VOCAB, labels=labels)  # the embedding raises inside the class forward
    assert logit_step_value(model) == value
    assert model._lowp_logit_step.running == 0


@pytest.mark.parametrize("model_type", sorted(lowp_head.LOGIT_TRANSFORMS))
def test_bf16_logit_steps_are_as_close_to_fp32_as_the_models_own(model_type):
    """In bf16 the model rounds its logits and each step to bf16, the fused loss soft-caps in fp32 and
    scales the hidden states: its loss and gradients are as close to the fp32 model's as the model's own
    bf16 ones (measured: 0.9-1.1x the model's gradient error; a missing step is off by percents)."""
    ids, labels = batch()
    fp32_loss, fp32 = loss_and_grads(tiny_model(model_type), ids, labels)
    ref = tiny_model(model_type, torch.bfloat16)
    loss_errors, grad_errors = {}, {}
    for name, model in (("own", ref), ("lowp", apply_lowp_ops(copy.deepcopy(ref)))):
        loss, grads = loss_and_grads(model, ids, labels)
        loss_errors[name] = float((loss.double() - fp32_loss.double()).abs() / fp32_loss.double())
        grad_errors[name] = max(
            float((grads[k].double() - g.double()).norm() / g.double().norm()) for k, g in fp32.items()
        )
    assert loss_errors["lowp"] <= max(1.5 * loss_errors["own"], 2e-4), loss_errors
    assert grad_errors["lowp"] <= 1.5 * grad_errors["own"], grad_errors


def test_loss_function_outside_the_patched_forward_is_refused():
    """The class's own forward would soft-cap the hidden states the patched head hands through."""
    model = apply_lowp_ops(tiny_model("gemma2"))
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="inside its patched forward only"):
        type(model).forward(model, input_ids=ids, labels=labels)


def test_concurrent_forwards_keep_the_step_switched_off():
    """Forwards of one model on several threads: each loss is the model's own, and the value is back
    once the last one ends (the first to start switches the step off, the last to end restores it)."""
    ref = tiny_model("gemma2")
    model = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = batch()
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels).loss
    start = threading.Barrier(4)
    losses = []

    def train_steps():
        start.wait()
        for _ in range(5):
            with torch.no_grad():
                losses.append(model(input_ids=ids, labels=labels).loss)

    threads = [threading.Thread(target=train_steps) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(losses) == 20
    for loss in losses:
        torch.testing.assert_close(loss, want, rtol=2e-6, atol=0)
    assert logit_step_value(model) == 0.05 and model._lowp_logit_step.running == 0


def test_softcap_is_the_models_own():
    """A soft-capping model refuses a second ``softcap``; a Gemma 3 built without one takes it as a loss
    option, and its loss then equals the soft-capping model's."""
    with pytest.raises(ValueError, match="soft-caps its logits itself"):
        apply_lowp_ops(tiny_model("gemma2"), softcap=30.0)
    capped = tiny_model("gemma3_text")
    uncapped = apply_lowp_ops(tiny_model("gemma3_text", final_logit_softcapping=None), softcap=0.05)
    ids, labels = batch()
    torch.testing.assert_close(
        uncapped(input_ids=ids, labels=labels).loss,
        capped(input_ids=ids, labels=labels).loss,
        rtol=2e-6,
        atol=0,
    )


def test_compiled_softcapped_loss_is_one_graph():
    """Dynamo traces the switch (attribute writes it replays): one graph, the eager loss, the value back."""
    model = apply_lowp_ops(tiny_model("gemma2"))
    ids, labels = batch()
    eager = model(input_ids=ids, labels=labels).loss
    counters.clear()
    compiled = torch.compile(
        lambda ids, labels: model(input_ids=ids, labels=labels).loss, backend="aot_eager", fullgraph=True
    )
    loss = compiled(ids, labels)
    loss.backward()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)
    assert logit_step_value(model) == 0.05 and model._lowp_logit_step.running == 0


# --------------------------------------------------------------------------------- compile, errors


@pytest.mark.parametrize(
    ("model_type", "options"),
    [("qwen3_moe", {"experts": "mxfp8", "grad_format": "mxfp8_e4m3"}), ("llama", {})],
    ids=["qwen3_moe-mxfp8", "llama"],
)
def test_compiled_loss_is_one_graph(model_type, options):
    """The whole patched forward with its loss in one Dynamo graph: no graph break anywhere, in lowp ops
    or around them (MoE: router, sorted and padded MXFP8 experts, MXFP8 LM-head gradient; Llama: the
    dense MLPs with their recomputed activation; both: the RMSNorms through lowp_ops.rms_norm, which
    ``rms_norm=True`` keeps under compile)."""
    model = apply_lowp_ops(tiny_model(model_type, torch.bfloat16), rms_norm=True, **options)
    ids, labels = batch()
    items = torch.tensor(int((labels[:, 1:] != -100).sum()))
    eager = model(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    counters.clear()
    compiled = torch.compile(
        lambda ids, labels: model(input_ids=ids, labels=labels, num_items_in_batch=items).loss,
        backend="aot_eager",
        fullgraph=True,
    )
    loss = compiled(ids, labels)
    loss.backward()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)


def lowp_ops_in_compiled_graph(model, ids, labels) -> set[str]:
    """The lowp:: ops of the graph Dynamo traces from the patched model's loss."""
    seen = set()

    def backend(graph_module, example_inputs):
        seen.update(str(n.target) for n in graph_module.graph.nodes if str(n.target).startswith("lowp."))
        return graph_module.forward

    loss = torch.compile(lambda i, t: model(input_ids=i, labels=t).loss, backend=backend, fullgraph=True)
    loss(ids, labels)
    return seen


@pytest.mark.parametrize(("rms_norm", "compiled_norm"), [("eager", False), (True, True)])
def test_rms_norm_eager_leaves_compiled_norms_to_inductor(rms_norm, compiled_norm, monkeypatch):
    """``rms_norm="eager"`` (the default): eager calls of a norm run lowp_ops.rms_norm, traced ones the
    module's own forward, so no lowp::rms_norm op reaches Inductor; ``True`` keeps the op traced too."""
    model = apply_lowp_ops(tiny_model("llama", torch.bfloat16), rms_norm=rms_norm)
    ids, labels = batch()
    norm = model.model.norm
    x = torch.randn(4, norm.weight.shape[0]).bfloat16()
    calls = []
    lowp_norm = lowp_layers.lowp_rms_norm
    monkeypatch.setattr(lowp_layers, "lowp_rms_norm", lambda *a, **k: calls.append(1) or lowp_norm(*a, **k))
    norm(x)
    assert calls, "the eager call did not run lowp_ops.rms_norm"
    monkeypatch.undo()
    ops = lowp_ops_in_compiled_graph(model, ids, labels)
    assert any(op.startswith("lowp.linear_cross_entropy") for op in ops), ops
    assert any(op.startswith("lowp.rms_norm") for op in ops) == compiled_norm, ops


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"grad_format": "fp8"}, ValueError, "grad_format"),
        ({"experts": "fp8"}, ValueError, "experts"),
        ({"softmax": "yes"}, TypeError, "softmax must be a bool"),
        ({"rms_norm": "always"}, ValueError, "rms_norm"),
        ({"chunk_sise": 256}, TypeError, "chunk_sise"),
        ({"process_group": object()}, NotImplementedError, "process_group"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    model = tiny_model("llama")
    with pytest.raises(error, match=message):
        apply_lowp_ops(model, **kwargs)
    assert "forward" not in vars(model)


def test_unchecked_model_types_are_refused():
    model = tiny_model("phimoe", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(NotImplementedError, match="phimoe"):
        apply_lowp_ops(model)
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.interp
def test_interp_patched_moe_runs_the_kernels():
    """The Triton kernels (under the interpreter) behind the patched LM head, experts and softmax."""
    ref = tiny_model("qwen3_moe", torch.bfloat16, attn_implementation="eager", num_hidden_layers=1)
    patched = apply_lowp_ops(copy.deepcopy(ref), experts="bf16", softmax=True)
    assert_same_training_signal(ref, patched, *batch(length=6), rtol=3e-2)


@pytest.mark.slow
def test_inductor_compiles_the_patched_moe():
    """Inductor lowers the patched step in one graph, with the eager loss and gradients to bf16
    tolerance (Inductor fuses the model's own bf16 ops and rounds them differently)."""
    ref = apply_lowp_ops(tiny_model("qwen3_moe", torch.bfloat16, num_hidden_layers=1), experts="bf16")
    compiled = copy.deepcopy(ref)
    ids, labels = batch()
    want_loss, want = loss_and_grads(ref, ids, labels)
    counters.clear()
    step = torch.compile(lambda ids, labels: compiled(input_ids=ids, labels=labels).loss, fullgraph=True)
    loss = step(ids, labels)
    loss.backward()
    assert not counters["graph_break"]
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    for name, p in compiled.named_parameters():
        error = (p.grad.double() - want[name].double()).norm() / want[name].double().norm()
        assert error <= 3e-2, f"{name}: {float(error):.2e}"


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_next"])
def test_gpu_soft_capped_loss_and_unit_offset_norms(model_type):
    """A patched bf16 training step on the GPU (Gemma 2: the soft-capped fused loss, its 1 + weight norms
    on the fp32-weight kernels; Qwen3-Next: the same norms beside its gated delta nets): loss and
    gradients within bf16 of the model's own."""
    ref = tiny_model(model_type, torch.bfloat16).cuda()
    patched = apply_lowp_ops(copy.deepcopy(ref))
    ids, labels = (t.cuda() for t in batch())
    want_loss, want = loss_and_grads(ref, ids, labels)
    got_loss, got = loss_and_grads(patched, ids, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-3, atol=0)
    for name, grad in want.items():
        error = (got[name].double() - grad.double()).norm() / grad.double().norm().clamp(min=1e-30)
        assert error <= 5e-2, f"{name}: gradient off by {float(error):.2e} of its norm"
