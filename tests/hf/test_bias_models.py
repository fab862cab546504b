"""Bias models without HF's attention hook (posenc.hf._bias_models): T5's relative bias and BLOOM's ALiBi
served by posenc equal HF."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

import posenc.hf as posenc_hf  # noqa: E402
from _hf_models import (  # noqa: E402
    EXACT,
    VOCAB,
    _inputs,
    _model,
    _run,
)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


def test_t5_relative_bias_reaches_posenc_and_equals_hf():
    """T5 hands its (trainable) relative bias over as position_bias: logits, the bias table's and every
    other gradient, and generate() equal HF's sdpa (encoder padding, causal decoder, cross-attention)."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).double().eval()
    ids = torch.randint(1, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0
    decoder_ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    results = {}
    for impl in ("sdpa", posenc_hf.ATTN_IMPLEMENTATION):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        results[impl] = (logits.detach(), grads, generated)
    (want, want_grads, want_gen), (got, got_grads, got_gen) = results.values()
    torch.testing.assert_close(got, want, **EXACT)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-9)
    assert torch.equal(got_gen, want_gen)


def test_bloom_runs_on_posenc_alibi_and_equals_hf():
    """BLOOM has no AttentionInterface hook: use_posenc_attention swaps its attention forward. HF's
    BLOOM in float64 gives nan on left-padded rows, so the comparison is float32: logits at the real
    tokens, gradients, and generate()."""
    import copy

    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM(config).eval()
    patched = posenc_hf.use_posenc_attention(copy.deepcopy(model))
    ids, mask = _inputs()
    (want, want_grads), (got, got_grads) = (_run(m, "eager", ids, mask, grads=True) for m in (model, patched))
    assert posenc_hf.last_backend() is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    generated = patched.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no attention posenc patches"):
        posenc_hf.use_posenc_attention(_model("llama"))


# ----------------------------------------------------------------------------
# HF T5 through posenc.hf.use_posenc_attention: equal to HF's own T5 (eager and sdpa).


T5_VOCAB = 50


T5_EXACT = {"rtol": 1e-9, "atol": 1e-9}


def _config(**kw):
    options = dict(
        vocab_size=T5_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
        dropout_rate=0.0,
    )  # fmt: skip
    options.update(kw)
    return transformers.T5Config(**options)


def _pair(model_class=None, impl: str = "eager", dtype=torch.float64, **config):
    """(HF's model with attention ``impl``, a deep copy served by posenc), equal weights."""
    torch.manual_seed(0)
    model_class = model_class or transformers.T5ForConditionalGeneration
    reference = model_class(_config(**config)).to(dtype).eval()
    with torch.no_grad():  # HF initialises the tables with std d_model^-0.5: make the bias matter more
        for name, param in reference.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                param.normal_(0.0, 1.0)
    reference.set_attn_implementation(impl)
    patched = posenc_hf.use_posenc_attention(copy.deepcopy(reference))
    return reference, patched


def _batch(src_len: int = 23, tgt_len: int = 11):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, T5_VOCAB, (3, src_len), generator=generator)
    mask = torch.ones(3, src_len, dtype=torch.long)
    mask[1, src_len - 7 :] = 0  # right padding
    mask[2, :5] = 0  # left padding (the encoder is bidirectional: every row still sees real keys)
    labels = torch.randint(1, T5_VOCAB, (3, tgt_len), generator=generator)
    decoder_mask = torch.ones(3, tgt_len, dtype=torch.long)
    decoder_mask[0, tgt_len - 3 :] = 0
    labels[0, tgt_len - 3 :] = -100
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "decoder_attention_mask": decoder_mask,
    }


def _outputs_and_grads(model, batch, **kwargs):
    model.zero_grad()
    out = model(**batch, **kwargs)
    weights = torch.linspace(-1, 1, out.logits.numel(), dtype=out.logits.dtype).view_as(out.logits)
    (out.loss + (out.logits * weights).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _block_masks_built_uncompiled(monkeypatch) -> list:
    """Make HF's flex_attention mask builder call ``create_block_mask`` uncompiled; the masks it
    builds are listed. HF compiles it (``_compile=True``), which costs seconds (much more when it is
    the process's first inductor compile), and what the caller tests is posenc's refusal of the
    BlockMask, which is the same BlockMask either way."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers import masking_utils

    built = []

    def uncompiled(*args, **kwargs):
        built.append(create_block_mask(*args, **{**kwargs, "_compile": False}))
        return built[-1]

    monkeypatch.setattr(masking_utils, "create_block_mask", uncompiled)  # raises if HF renamed it
    return built


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_seq2seq_logits_loss_and_gradients_equal_hf(impl):
    reference, patched = _pair(impl=impl)
    batch = _batch()
    want, want_grads = _outputs_and_grads(reference, batch)
    got, got_grads = _outputs_and_grads(patched, batch)
    assert posenc_hf.last_backend() is not None
    torch.testing.assert_close(got.encoder_last_hidden_state, want.encoder_last_hidden_state, **T5_EXACT)
    torch.testing.assert_close(got.logits, want.logits, **T5_EXACT)
    torch.testing.assert_close(got.loss, want.loss, **T5_EXACT)
    assert got_grads.keys() == want_grads.keys()
    for table in ("encoder", "decoder"):
        assert f"{table}.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in got_grads
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-8, atol=1e-9, msg=name)


def test_training_with_gradient_checkpointing_equals_hf():
    reference, patched = _pair(impl="sdpa")
    for model in (reference, patched):
        model.gradient_checkpointing_enable()
        model.train()  # dropout_rate is 0: training mode changes nothing but the checkpointing
    batch = _batch()
    want, want_grads = _outputs_and_grads(reference, batch)
    got, got_grads = _outputs_and_grads(patched, batch)
    torch.testing.assert_close(got.loss, want.loss, **T5_EXACT)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-8, atol=1e-9, msg=name)


def test_the_bias_table_is_hf_s_own_parameter_and_the_state_dict_is_unchanged():
    reference, patched = _pair()
    for stack in (patched.encoder, patched.decoder):
        table = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        for block in stack.block:
            assert block.layer[0].SelfAttention.posenc_encoding.table.weight is table
    assert patched.encoder.block[1].layer[0].SelfAttention.posenc_encoding.bidirectional
    assert not patched.decoder.block[0].layer[0].SelfAttention.posenc_encoding.bidirectional
    assert list(patched.state_dict()) == list(reference.state_dict())
    assert len(list(patched.parameters())) == len(list(reference.parameters()))
    with torch.no_grad():  # an edit of HF's table is what posenc reads
        patched.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(3.0)
        reference.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(3.0)
    batch = _batch()
    torch.testing.assert_close(patched(**batch).logits, reference(**batch).logits, **T5_EXACT)
    patched.set_attn_implementation("eager")  # HF's float masks, dense even without padding
    torch.testing.assert_close(patched(**batch).logits, reference(**batch).logits, **T5_EXACT)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_equals_hf(num_beams):
    reference, patched = _pair(impl="sdpa", num_decoder_layers=2)  # HF's cache sizes itself by num_layers
    batch = _batch()
    kwargs = {"max_new_tokens": 9, "do_sample": False, "num_beams": num_beams}
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    want = reference.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    got = patched.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 9
    for g, w in zip(got.scores, want.scores, strict=True):  # every step's scores, not only their argmax
        torch.testing.assert_close(g, w, **T5_EXACT)


def test_encoder_model_and_attention_weights_equal_hf():
    reference, patched = _pair(transformers.T5EncoderModel)
    batch = _batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    want = reference(**inputs, output_attentions=True)
    got = patched(**inputs, output_attentions=True)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **T5_EXACT)
    assert len(got.attentions) == len(want.attentions) == 2
    for g, w in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, w, **T5_EXACT)


def test_a_t5_inside_a_plain_container_gets_posenc_masks_too():
    reference, _ = _pair(transformers.T5EncoderModel)
    container = torch.nn.ModuleDict({"t5": copy.deepcopy(reference)})  # no set_attn_implementation
    posenc_hf.use_posenc_attention(container)
    assert container["t5"].encoder.config._attn_implementation == posenc_hf.ATTN_IMPLEMENTATION
    batch = _batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    torch.testing.assert_close(
        container["t5"](**inputs).last_hidden_state, reference(**inputs).last_hidden_state, **T5_EXACT
    )


def test_mt5_equals_hf():
    torch.manual_seed(0)
    options = _config().to_dict()
    reference = transformers.MT5ForConditionalGeneration(transformers.MT5Config(**options)).double().eval()
    patched = posenc_hf.use_posenc_attention(copy.deepcopy(reference))
    batch = _batch()
    torch.testing.assert_close(patched(**batch).logits, reference(**batch).logits, **T5_EXACT)


def test_long_sequences_take_the_near_far_split_and_equal_hf():
    """Past the split's minimum length an unpadded encoder (no mask) and causal decoder run the near/far
    split in float32; HF's float64 model is the reference, forward and the bias tables' gradients."""
    length = 1100
    reference, patched = _pair(
        impl="eager", dtype=torch.float32, d_model=32, d_kv=16, num_heads=2, num_layers=1, num_decoder_layers=1,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
    )  # fmt: skip
    reference.double()
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, T5_VOCAB, (1, length), generator=generator)
    labels = torch.randint(1, T5_VOCAB, (1, length), generator=generator)
    want, want_grads = _outputs_and_grads(reference, {"input_ids": ids, "labels": labels})
    ran = {}

    def record(stack: str):
        def hook(*_) -> None:
            ran.setdefault(stack, posenc_hf.last_backend())

        return hook

    for stack in ("encoder", "decoder"):
        getattr(patched, stack).block[0].layer[0].SelfAttention.register_forward_hook(record(stack))
    got, got_grads = _outputs_and_grads(patched, {"input_ids": ids, "labels": labels})
    assert ran == {"encoder": "near_far", "decoder": "near_far"}  # no mask, and a causal one
    torch.testing.assert_close(got.logits.double(), want.logits, rtol=1e-4, atol=1e-4)
    for stack in ("encoder", "decoder"):
        name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        torch.testing.assert_close(got_grads[name].double(), want_grads[name], rtol=1e-3, atol=1e-4)


def test_what_is_not_served_is_refused(monkeypatch):
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=T5_VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    with pytest.raises(
        ValueError, match=r"LlamaForCausalLM has no attention posenc patches \(served: .*T5Attention"
    ):
        posenc_hf.use_posenc_attention(llama)
    umt5 = transformers.UMT5EncoderModel(
        transformers.UMT5Config(vocab_size=T5_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    )
    with pytest.raises(ValueError, match="UMT5EncoderModel has no attention posenc patches"):
        posenc_hf.use_posenc_attention(umt5)
    with pytest.raises(ValueError, match="T5EncoderModel's relative_attention_num_buckets"):
        posenc_hf.use_posenc_attention(
            transformers.T5EncoderModel(
                _config(relative_attention_num_buckets=8, relative_attention_max_distance=2)
            )
        )
    old_style = transformers.T5EncoderModel(_config())
    del old_style.encoder.block[0].layer[0].SelfAttention.is_causal  # as before transformers 5.15
    with pytest.raises(
        ValueError, match=r"T5Attention.forward .* lacking attribute is_causal\. posenc supports "
    ):
        posenc_hf.use_posenc_attention(old_style)
    _, patched = _pair(transformers.T5EncoderModel)
    patched.set_attn_implementation("flex_attention")  # HF then builds a BlockMask
    block_masks = _block_masks_built_uncompiled(monkeypatch)
    batch = _batch()
    with pytest.raises(ValueError, match="passed its attention a BlockMask mask"):
        patched(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert len(block_masks) == 1  # HF's own flex mask path built the mask posenc refused
    attention = patched.encoder.block[0].layer[0].SelfAttention
    with pytest.raises(ValueError, match="position_bias must be None"):
        attention(torch.zeros(1, 3, 32, dtype=torch.float64), position_bias=torch.zeros(1, 4, 3, 3))
