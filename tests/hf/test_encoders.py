"""BERT and MPNet through posenc.hf on tiny random configs (nothing downloaded).

* MPNet has no ``AttentionInterface`` hook (it adds its mask and T5-bucketed relative bias itself):
  ``use_posenc_attention`` runs its self-attention on posenc's backends with posenc's ``t5`` on the
  encoder's table. Hidden states, attention weights and every gradient equal HF's eager MPNet (its
  only implementation) on a padded batch, under either mask form HF hands it.
* The bias itself: posenc's ``t5`` loaded with MPNet's table gives ``MPNetEncoder.compute_position_bias``
  exactly at every relative position in [-600, 600]; the bucket no relative position reaches (derived
  from the bucket formula written out here) gets no gradient, so training leaves it at its initial value.
* BERT's learned table loaded into posenc's ``learned`` gives HF's position embeddings exactly.
* ``swap_encoding`` on BERT and MPNet: ALiBi in place of the learned table or of MPNet's bias equals
  HF's own model fed the ALiBi bias written out here, sinusoidal in place of BERT's table equals HF's
  model with the formula's table, and each swap warns what it changed.

float64 throughout: posenc against HF to 1e-9.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")

import posenc  # noqa: E402
import posenc.hf as posenc_hf  # noqa: E402
from _encoder_references import symmetric_alibi, t5_bucket, unreached_buckets, with_padding  # noqa: E402

VOCAB, LEN = 40, 11
EXACT = {"rtol": 1e-9, "atol": 1e-9}
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


def _mpnet(impl: str = "eager", **config):
    """A tiny MPNetModel (float64, eval) whose bias table is drawn with std 1, so the bias matters."""
    torch.manual_seed(0)
    model = transformers.MPNetModel._from_config(
        transformers.MPNetConfig(**{**SIZES, **config}), attn_implementation=impl
    )
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    return model.double().eval()


def _bert(impl: str = "eager"):
    torch.manual_seed(0)
    config = transformers.BertConfig(**SIZES)
    return (
        transformers.BertModel._from_config(config, add_pooling_layer=False, attn_implementation=impl)
        .double()
        .eval()
    )


def _batch(pad: int):
    """Ids ``[3, LEN]`` and their mask: row 1 right-padded, row 2 left-padded (pads hold ``pad``)."""
    ids = torch.randint(3, VOCAB, (3, LEN), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, LEN, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, :3] = 0
    return ids.masked_fill(mask == 0, pad), mask


def _grads(model, ids, mask):
    model.zero_grad()
    out = model(ids, attention_mask=mask).last_hidden_state
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------- MPNet's bias is posenc's t5


def _hf_bias(model, length: int) -> torch.Tensor:
    """HF's dense bias ``[H, L, L]`` over token indices ``0 .. length-1`` (so ``j - i`` spans ±(length-1))."""
    encoder = model.encoder
    with torch.no_grad():
        return type(encoder).compute_position_bias(encoder, torch.zeros(1, length, 1))[0]


def _posenc_bias(encoding, heads: int, length: int) -> torch.Tensor:
    pos = torch.arange(length)
    return encoding.bias_at(torch.arange(heads)[:, None, None], pos[None, :, None], pos[None, None, :])


def test_mpnet_s_relative_bias_is_posenc_t5_on_its_table_at_every_distance_to_600():
    model = _mpnet()
    table = model.encoder.relative_attention_bias.weight
    encoding = posenc.build("t5", num_heads=4, num_buckets=32, max_distance=128, bidirectional=True).double()
    encoding.load_state_dict({"table.weight": table.detach()})
    want = _hf_bias(model, 601)  # relative positions -600 .. 600
    with torch.no_grad():
        assert torch.equal(_posenc_bias(encoding, 4, 601), want)
        # The bridge's encoding is the same function on HF's own parameter (shared, not copied).
        served = posenc_hf.use_posenc_attention(model)
        bridged = served.encoder.layer[1].attention.attn.posenc_encoding
        assert bridged.table.weight is table
        assert torch.equal(_posenc_bias(bridged, 4, 601), want)


def test_the_unreached_bucket_gets_no_gradient_and_keeps_its_initial_value():
    """Bidirectionally, ``r = 0`` falls in the lower half, so the upper half's first bucket (``half + 0``)
    is never used. HF initialises MPNet's table with ``N(0, initializer_range²)`` (a random draw, not
    zero); the row of that bucket gets an exact zero gradient from HF and from posenc, and a training
    step (SGD, no weight decay) leaves it exactly as drawn while every other row moves."""
    (unreached,) = unreached_buckets()
    ids, mask = _batch(pad=1)
    reference = _mpnet()
    initial = reference.encoder.relative_attention_bias.weight.detach().clone()
    assert initial[unreached].abs().min() > 0  # HF's init is a random draw, not zeros
    served = posenc_hf.use_posenc_attention(copy.deepcopy(reference))
    name = "encoder.relative_attention_bias.weight"
    for model in (reference, served):
        _, grads = _grads(model, ids, mask)
        assert torch.equal(grads[name][unreached], torch.zeros(4, dtype=torch.float64))
        reached = [b for b in range(32) if b != unreached]
        # LEN = 11 reaches the buckets of |r| <= 10 only; those rows all get a gradient.
        used = sorted({t5_bucket(r) for r in range(-LEN + 1, LEN)})
        assert all(grads[name][b].abs().max() > 0 for b in used) and set(used) <= set(reached)
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        weight = model.encoder.relative_attention_bias.weight.detach()
        assert torch.equal(weight[unreached], initial[unreached])
        assert all(not torch.equal(weight[b], initial[b]) for b in used)


# ---------------------------------------------------------------------------- MPNet through posenc


class _MaskSpy:
    """The mask dtypes MPNet's first self-attention was handed."""

    def __init__(self, model) -> None:
        self.dtypes: list = []
        model.encoder.layer[0].attention.attn.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        self.dtypes.append(None if mask is None else mask.dtype)


@pytest.mark.parametrize("impl", ["eager", posenc_hf.ATTN_IMPLEMENTATION])
def test_mpnet_through_posenc_equals_hf_eagerwith_padding(impl):
    """Loaded as eager, MPNet's attention gets HF's float mask (0 or the minimum); loaded as "posenc",
    once served, ``sdpa_mask``'s bool mask (True = attend), which MPNet's own attention would add as
    numbers (hiding nothing). The bridge reads both: hidden states, attention weights and every
    gradient (the bias table's included) equal HF eager's, padded rows and all."""
    ids, mask = _batch(pad=1)
    reference = _mpnet("eager")
    served = _mpnet(impl)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "posenc serves none of its attention" for a served model
        posenc_hf.use_posenc_attention(served)
        spy = _MaskSpy(served)
        want, want_grads = _grads(reference, ids, mask)
        got, got_grads = _grads(served, ids, mask)
    assert spy.dtypes == [torch.float64 if impl == "eager" else torch.bool]
    assert posenc_hf.last_backend() is not None
    torch.testing.assert_close(got, want, **EXACT)
    assert got_grads.keys() == want_grads.keys() and "encoder.relative_attention_bias.weight" in got_grads
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-8, atol=1e-9, msg=name)
    with torch.no_grad():
        want_out = reference(ids, attention_mask=mask, output_attentions=True)
        got_out = served(ids, attention_mask=mask, output_attentions=True)
        torch.testing.assert_close(served(ids).last_hidden_state, reference(ids).last_hidden_state, **EXACT)
    assert len(got_out.attentions) == len(want_out.attentions) == 2
    for g, w in zip(got_out.attentions, want_out.attentions, strict=True):
        torch.testing.assert_close(g, w, **EXACT)
    assert list(served.state_dict()) == list(reference.state_dict())  # the table stays HF's parameter


def test_a_long_unpadded_mpnet_batch_takes_the_near_far_split_without_a_dense_bias():
    """Past the split's 1024 queries an unpadded batch (no mask) runs on near_far in float32; HF's
    float64 model is the reference. The encoder built no dense bias (its compute_position_bias is
    stood in for)."""
    length = 1030
    reference = _mpnet(max_position_embeddings=length + 2)
    served = posenc_hf.use_posenc_attention(copy.deepcopy(reference).float())
    ran = []
    served.encoder.layer[0].attention.attn.register_forward_hook(
        lambda *_: ran.append(posenc_hf.last_backend())
    )
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = served(ids).last_hidden_state
        want = reference(ids).last_hidden_state
    assert ran == ["near_far"]
    assert served.encoder.compute_position_bias(torch.zeros(1, length, 1)) is None
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_what_the_mpnet_bridge_cannot_serve_is_refused(monkeypatch):
    from transformers.models.mpnet import modeling_mpnet

    from posenc.seams import TRANSFORMERS_RANGE

    with pytest.raises(ValueError, match=r"relative_attention_bias has 16 rows .* buckets into 32"):
        posenc_hf.use_posenc_attention(_mpnet(relative_attention_num_buckets=16))
    served = posenc_hf.use_posenc_attention(_mpnet())
    attention = served.encoder.layer[0].attention.attn
    with pytest.raises(ValueError, match="position_bias must be None"):
        attention(torch.zeros(1, 3, 32, dtype=torch.float64), position_bias=torch.zeros(1, 4, 3, 3))

    def bucket(relative_position, num_buckets=32, max_distance=None):
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_mpnet.MPNetEncoder, "relative_position_bucket", staticmethod(bucket))
    with pytest.raises(
        ValueError, match=r"MPNetEncoder.relative_position_bucket .* an integer default for max_distance"
    ):
        posenc_hf.use_posenc_attention(_mpnet())
    monkeypatch.undo()

    def forward(self, hidden_states, attention_mask=None, relative_bias=None, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_mpnet.MPNetSelfAttention, "forward", forward)
    model = _mpnet()
    with pytest.raises(ValueError) as info:
        posenc_hf.use_posenc_attention(model)
    message = str(info.value)
    assert "MPNetSelfAttention.forward" in message and "lacking position_bias, output_attentions" in message
    assert f"transformers{TRANSFORMERS_RANGE}" in message and "attn_implementation='eager'" in message
    assert "compute_position_bias" not in model.encoder.__dict__  # refused before anything changed


# ---------------------------------------------------------------------------- learned tables


def test_bert_s_learned_table_loaded_into_posenc_s_learned_gives_hf_s_position_embeddings():
    model = _bert()
    hf_table = model.embeddings.position_embeddings
    encoding = posenc.build("learned", dim=32, max_len=64).double()
    encoding.table.load_state_dict(hf_table.state_dict())
    positions = torch.tensor([[0, 1, 2, 63], [5, 5, 40, 7]])
    with torch.no_grad():
        assert torch.equal(encoding.encode(positions), hf_table(positions))


def test_bert_through_posenc_equals_hf_sdpa_and_eagerwith_padding():
    ids, mask = _batch(pad=0)
    model = _bert("sdpa")
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
        got = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, **EXACT)
    torch.testing.assert_close(got, eager, **EXACT)


# ---------------------------------------------------------------------------- swap_encoding on encoders


@pytest.mark.parametrize("keep", [False, True])
def test_bert_with_alibi_in_place_of_its_table_equals_hf_fed_the_bias(keep):
    ids, mask = _batch(pad=0)
    reference = _bert("eager")
    swapped = copy.deepcopy(reference)
    told = (
        "kept the learned absolute positions"
        if keep
        else r"removed the learned absolute positions \(64 x 32\)"
    )
    with pytest.warns(
        UserWarning,
        match=rf"BertModel: added 'alibi:num_heads=4,mode=symmetric' in the attention of its 2 layers; {told}",
    ):
        posenc_hf.swap_encoding(swapped, "alibi", keep_absolute=keep)
    if not keep:
        with torch.no_grad():
            reference.embeddings.position_embeddings.weight.zero_()
    with torch.no_grad():
        want = reference(ids, attention_mask=with_padding(symmetric_alibi(4, LEN), mask)).last_hidden_state
        got = swapped(ids, attention_mask=mask).last_hidden_state
        assert (got - reference(ids, attention_mask=mask).last_hidden_state).abs().max() > 1e-3  # ALiBi acted
    torch.testing.assert_close(got, want, **EXACT)
    assert ("embeddings.position_embeddings.weight" in swapped.state_dict()) == keep


def test_bert_with_sinusoidal_in_place_of_its_table_equals_hf_with_the_formula_s_table():
    ids, mask = _batch(pad=0)
    reference = _bert("sdpa")
    swapped = copy.deepcopy(reference)
    with pytest.warns(
        UserWarning, match=r"replaced the learned absolute positions \(64 x 32\) by posenc's 'sinusoidal"
    ):
        posenc_hf.swap_encoding(swapped, "sinusoidal")
    pos = torch.arange(64, dtype=torch.float64)[:, None]
    omega = 10000.0 ** (-torch.arange(16, dtype=torch.float64) * 2 / 32)
    table = torch.stack([torch.sin(pos * omega), torch.cos(pos * omega)], -1).reshape(64, 32)  # interleaved
    with torch.no_grad():
        reference.embeddings.position_embeddings.weight.copy_(table)
        torch.testing.assert_close(
            swapped(ids, attention_mask=mask).last_hidden_state,
            reference(ids, attention_mask=mask).last_hidden_state,
            rtol=1e-7,
            atol=1e-7,
        )  # fmt: skip (posenc's sinusoidal table is float32, as its derived tables are)


@pytest.mark.parametrize("keep", [False, True])
def test_mpnet_with_alibi_in_place_of_its_bias_equals_hf_fed_the_bias(keep):
    ids, mask = _batch(pad=1)
    reference = _mpnet()
    swapped = copy.deepcopy(reference)
    with pytest.warns(
        UserWarning,
        match=r"MPNetModel: replaced its relative bias \(T5 buckets, one table for every layer\) by 'alibi:num_heads=4,mode=symmetric'",
    ):
        posenc_hf.swap_encoding(swapped, "alibi", keep_absolute=keep)
    alibi = symmetric_alibi(4, LEN)
    reference.encoder.compute_position_bias = lambda x, *args, **kwargs: alibi[None].expand(
        x.shape[0], -1, -1, -1
    )
    if not keep:
        with torch.no_grad():
            reference.embeddings.position_embeddings.weight.zero_()
    with torch.no_grad():
        torch.testing.assert_close(
            swapped(ids, attention_mask=mask).last_hidden_state,
            reference(ids, attention_mask=mask).last_hidden_state,
            **EXACT,
        )


def test_what_swap_encoding_cannot_do_on_an_encoder_is_refused():
    with pytest.raises(
        ValueError, match=r"MPNetModel counts its absolute positions from padding_idx \+ 1 = 2"
    ):
        posenc_hf.swap_encoding(_mpnet(), "sinusoidal")
    with pytest.raises(ValueError, match="keep_absolute=True keeps the learned absolute positions"):
        posenc_hf.swap_encoding(_bert(), "sinusoidal", keep_absolute=True)
    with pytest.raises(ValueError, match="one spec, not one per layer"):
        posenc_hf.swap_encoding(_bert(), ["sinusoidal", "alibi"])
    with pytest.raises(
        ValueError, match=r"layer 0: 'alibi:num_heads=4,mode=causal' is defined for causal attention only"
    ):
        posenc_hf.swap_encoding(_bert(), "alibi:mode=causal")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)
    )  # fmt: skip
    with pytest.raises(
        ValueError, match="keep_absolute=True, but LlamaForCausalLM has no learned absolute table"
    ):
        posenc_hf.swap_encoding(llama, "alibi", keep_absolute=True)
    bert = _bert()
    with pytest.warns(UserWarning):
        posenc_hf.swap_encoding(bert, "alibi")
    with pytest.raises(ValueError, match="position table was swapped already"):
        posenc_hf.swap_encoding(bert, "t5")
