"""Padded and packed batches through ``posenc.hf`` (issue 49, item 11): left-padded batched
``generate`` equals each prompt alone, right-padded cached generation is warned of, and a packed
batch's position ids are never read as M-RoPE's 3-axis ids.

Tiny random Llama in float64 (nothing downloaded), with HF's rotary embedding (``attn_implementation=
"posenc"``) and with posenc's own (``swap_encoding``: the positions of the cached keys are posenc's).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
import posenc.hf as posenc_hf  # noqa: E402
from posenc.hf._positions import swapped_positions  # noqa: E402

VOCAB, PAD = 50, 0
CLOSE = {"rtol": 1e-7, "atol": 1e-7}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()


def _llama(how: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
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
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in (5, 9, 13)]


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
    ids = torch.randint(1, VOCAB, (3, 11), generator=generator)
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
