"""A swapped model's key positions, kept beside HF's cache (posenc.hf._positions): a cropped cache (assisted
generation, prompt lookup) continues as the full pass; a cache whose keys cannot be placed is refused; the
kept positions survive a write into them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

transformers = pytest.importorskip("transformers")


import posenc.hf as posenc_hf  # noqa: E402
from _hf_models import (  # noqa: E402
    LEN,
    _inputs,
    _model,
    _swapped,
)
from posenc.hf._positions import swapped_positions  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()
    yield
    posenc_hf.register()  # back to the "auto" backend


# ---------------------------------------------------------------------------- swapped models under HF's crop
#: Swapped encodings that read the keys' positions, one of each kind: rotary, bias (ALiBi, T5's
#: buckets) and content (Shaw's relative keys).
CROP_SPECS = ["rope:base=10000.0", "alibi", "t5:num_buckets=8,max_distance=16", "shaw"]

#: float64 run through calls of other shapes (another summation order): rounding is ~1e-15 relative;
#: one key at a wrong position moved these logits by 1e-3 to 1e-1 (the positions kept before a crop).
CROP_EXACT = {"rtol": 1e-10, "atol": 1e-10}

#: ``generate``'s logits are float32 copies of the float64 ones: equal float64 logits round to
#: float32 values one ulp apart at most.
FLOAT32_ROUNDING = {"rtol": 1e-6, "atol": 1e-7}


@pytest.mark.parametrize("spec", CROP_SPECS)
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_a_swapped_model_s_cropped_cache_continues_as_the_full_pass(name, spec):
    """HF's assisted and speculative generation crop the cache after a rejected draft. After a crop,
    the keys a swapped layer is handed are the cache's own, at their own positions (read off the
    cache's length): multi-token continuations equal the full pass, in full layers and in a sliding
    window (mistral's 6 < the 9 tokens prefilled), for a left-padded batch."""
    model = _swapped(name, spec)
    ids, mask = _inputs()
    cache = transformers.DynamicCache(config=model.config)
    cache.activate_past_recording()  # what HF's generate does before it crops (a sliding layer needs it)
    got = {}
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
        # (tokens to crop, then the next tokens to run): a rejected draft of 3 and a continuation of
        # 6, one of 2 and a continuation of 3, none (HF's crop(0) between steps) and the rest
        for crop, stop in ((-3, 12), (-2, 13), (0, LEN)):
            cache.crop(crop)
            start = cache.get_seq_length()
            out = model(
                ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache, use_cache=True
            )
            got[start, stop] = out.logits
    assert list(got) == [(6, 12), (10, 13), (13, LEN)]
    for (start, stop), logits in got.items():
        torch.testing.assert_close(logits, full[:, start:stop], **CROP_EXACT)


def _prompt_with_repeats():
    """A prompt whose n-grams repeat, so prompt lookup proposes drafts (which the model rejects)."""
    return torch.tensor([[3, 14, 15, 9, 26, 5, 35] * 3])


@pytest.mark.parametrize("assistant", ["draft_model", "prompt_lookup"])
@pytest.mark.parametrize("spec", CROP_SPECS[:3])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_assisted_generation_of_a_swapped_model_equals_its_greedy_generation(
    name, spec, assistant, monkeypatch
):
    """``generate(assistant_model=...)`` and prompt lookup verify a draft in one call and crop what
    was rejected: the tokens and every step's logits equal the same swapped model's plain greedy
    generation and its full pass (a swapped draft model crops its own cache too)."""
    from transformers.cache_utils import Cache

    crops: list[int] = []
    real_crop = Cache.crop
    monkeypatch.setattr(Cache, "crop", lambda cache, n: crops.append(int(n)) or real_crop(cache, n))
    model = _swapped(name, spec)
    if assistant == "draft_model":
        ids, extra = _inputs()[0][:1], {"assistant_model": _swapped(name, spec, seed=1)}
    else:
        ids, extra = _prompt_with_repeats(), {"prompt_lookup_num_tokens": 3}
    options = {
        "max_new_tokens": 10,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    with torch.no_grad():
        assisted = model.generate(ids, **extra, **options)
        assert any(n < 0 for n in crops)  # a draft was rejected and cropped
        greedy = model.generate(ids, **options)
        full = model(assisted.sequences).logits[:, ids.shape[1] - 1 : -1]
    assert torch.equal(assisted.sequences, greedy.sequences)
    steps = torch.stack(assisted.logits, 1)  # [1, 10, V]
    torch.testing.assert_close(steps, torch.stack(greedy.logits, 1), **FLOAT32_ROUNDING)
    torch.testing.assert_close(steps, full.to(steps.dtype), **FLOAT32_ROUNDING)


def test_a_swapped_model_refuses_a_cache_whose_keys_it_cannot_place():
    """Nothing silent: a cache written by the unswapped model holds keys at positions nobody kept, an
    object without ``get_seq_length`` tells no length (HF's static cache is served:
    tests/hf/test_static_cache.py)."""

    model = _swapped("llama", "alibi")
    ids = _inputs()[0][:1]
    plain = _model("llama")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        plain(ids[:, :5], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="layer 0 kept the positions of none"):
            model(ids[:, 5:], past_key_values=cache, use_cache=True)

    class NoLength:
        pass

    attention = model.model.layers[0].self_attn
    attention.__dict__["_posenc_call_cache"] = NoLength()
    with pytest.raises(ValueError, match=r"NoLength, does not tell its length \(get_seq_length\(0\)"):
        swapped_positions(attention, torch.arange(3)[None], 3, 3, torch.device("cpu"))


def test_the_bridges_kept_positions_survive_a_write_into_them():
    """The positions of an encoding-free call are views of a kept ``arange``; a write into one (by
    anyone) must not reach the next call's positions."""
    from posenc.kernels.position_ranges import counting_positions as _counting

    cpu = torch.device("cpu")
    first = _counting(5, cpu)
    assert torch.equal(first, torch.arange(5)[None])
    first += 7
    assert torch.equal(_counting(5, cpu), torch.arange(5)[None])
    assert torch.equal(_counting(9000, cpu), torch.arange(9000)[None])  # grows past the kept length


# ----------------------------------------------------------------------------
# Padded and packed batches through ``posenc.hf`` (issue 49, item 11): left-padded batched ``generate``
# equals each prompt alone, right-padded cached generation is warned of, and a packed batch's position ids
# are never read as M-RoPE's 3-axis ids.


PADDED_VOCAB, PAD = 50, 0


CLOSE = {"rtol": 1e-7, "atol": 1e-7}


def _llama(how: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=PADDED_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double().eval()
    if how == "swapped":
        return posenc_hf.swap_encoding(model, "rope")
    if how == "swapped-mrope":
        return posenc_hf.swap_encoding(model, "mrope")
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    return model


def _prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, PADDED_VOCAB, (n,), generator=generator) for n in (5, 9, 13)]


def _generate(model, ids, mask):
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=PAD,
    )  # fmt: skip
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("how", ["hf-rope", "swapped"])
def test_left_padded_batched_generate_equals_each_prompt_alone(how):
    """unsloth issue 3699: batched generation of left-padded prompts must give each row what the
    prompt gives alone (four fixes were declined there for want of this test)."""
    model = _llama(how)
    prompts = _prompts()
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), PAD)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = prompt
        mask[row, longest - len(prompt) :] = 1
    with torch.no_grad():
        tokens, logits = _generate(model, ids, mask)
        for row, prompt in enumerate(prompts):
            alone_tokens, alone_logits = _generate(
                model, prompt[None], torch.ones(1, len(prompt), dtype=torch.long)
            )
            assert torch.equal(tokens[row], alone_tokens[0]), f"row {row} (prompt of {len(prompt)} tokens)"
            torch.testing.assert_close(logits[row], alone_logits[0], **CLOSE)


@pytest.mark.parametrize("how", ["hf-rope", "swapped"])
def test_right_padded_cached_generation_is_warned_of(how):
    """HF PR 48161: a right-padded prompt continued with a cache puts the pads between the prompt and
    the new tokens; posenc warns, saying to pad on the left. Left padding and uncached right
    padding (an encoder-style batch) are not warned of."""
    model = _llama(how)
    prompts = _prompts()[:2]
    longest = max(len(p) for p in prompts)
    ids = torch.full((2, longest), PAD)
    right = torch.zeros(2, longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
        right[row, : len(prompt)] = 1
    with (
        torch.no_grad(),
        pytest.warns(UserWarning, match=r"rows \[0\].*pad decoder-only prompts on the left"),
    ):
        _generate(model, ids, right)
    import warnings

    left_ids, left = ids.clone(), torch.zeros_like(right)
    for row, prompt in enumerate(prompts):
        left_ids[row] = PAD
        left_ids[row, longest - len(prompt) :] = prompt
        left[row, longest - len(prompt) :] = 1
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="posenc.hf")
        _generate(model, left_ids, left)
        model(ids, attention_mask=right, use_cache=False)


def test_a_packed_batch_of_three_rows_is_never_read_as_mrope_axis_ids():
    """HF PR 44911: M-RoPE's 3-axis ids ``[3, T]`` and a packed batch of three rows ``[3, T]`` (position
    ids restarting at each document) have the same shape. A swapped M-RoPE layer reads the packed
    rows as one text position per token: each document equals itself alone."""
    model = _llama("swapped-mrope")
    generator = torch.Generator().manual_seed(4)
    splits = [(4, 7), (6, 5), (3, 8)]  # two documents per row, 11 tokens
    ids = torch.randint(1, PADDED_VOCAB, (3, 11), generator=generator)
    position_ids = torch.stack([torch.cat([torch.arange(a), torch.arange(b)]) for a, b in splits])
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits
        for row, (a, _) in enumerate(splits):
            for start, stop in ((0, a), (a, 11)):
                alone = model(ids[row : row + 1, start:stop], use_cache=False).logits[0]
                torch.testing.assert_close(packed[row, start:stop], alone, **CLOSE)


def test_three_dimensional_position_ids_are_refused_naming_them():
    """Ids ``[3, B, T]`` reaching a swapped layer are refused, not taken as axes or rows."""
    model = _llama("swapped")
    attention = model.model.layers[0].self_attn
    attention.__dict__["_posenc_call_cache"] = None
    ids = torch.arange(6).expand(3, 1, 6)
    with pytest.raises(ValueError, match=r"position_ids has shape \(3, 1, 6\).*\[B, T\]"):
        swapped_positions(attention, ids, 6, 6, torch.device("cpu"))
    q_pos, k_pos = swapped_positions(attention, ids[0], 6, 6, torch.device("cpu"))
    assert q_pos.shape == k_pos.shape == (1, 6)
