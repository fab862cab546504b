"""posenc's mask interface in HF: a plain sliding window reaches posenc as its window, never built dense.

HF builds each layer type's mask through the mask interface of ``attn_implementation``; posenc's
(:func:`posenc.hf._masks.posenc_mask`) returns None for a fresh, unpadded sliding-window prefill of
a model whose attention calls were seen to carry ``sliding_window`` (its first forward shows it),
and the attention function applies ``sliding_window`` itself. The references are HF's own: its
mask functions and ``sdpa_mask`` (what the skipped mask would have been), and the same tiny random
Gemma 3 run with HF's ``sdpa`` in float64. Padded and packed batches keep HF's dense mask.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
import posenc.hf as posenc_hf  # noqa: E402
import posenc.hf._attention as bridge  # noqa: E402
from posenc.hf._masks import plain_window  # noqa: E402

mu = pytest.importorskip("transformers.masking_utils")

VOCAB, LEN, WINDOW = 50, 19, 5
EXACT = {"rtol": 1e-9, "atol": 1e-9}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    posenc_hf.register()


def _gemma3():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    return transformers.Gemma3ForCausalLM(config).double().eval()


def _mask_kwargs(**changes):
    kwargs = dict(
        batch_size=1, q_length=12, kv_length=12, q_offset=0, kv_offset=0, attention_mask=None,
        mask_function=mu.sliding_window_causal_mask_function(4), local_size=4, allow_is_causal_skip=True,
        use_vmap=False, device="cpu",
    )  # fmt: skip
    kwargs.update(changes)
    return kwargs


def test_plain_window_is_read_only_off_hf_s_own_unpadded_sliding_prefill():
    # What the skip stands for: HF's dense mask is causal with the last 4 keys (written out here).
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    assert torch.equal(mu.sdpa_mask(**_mask_kwargs())[0, 0], (j <= i) & (j > i - 4))
    assert plain_window(_mask_kwargs()) == 4
    assert plain_window(_mask_kwargs(attention_mask=torch.ones(1, 12, dtype=torch.bool))) == 4
    padded = torch.ones(1, 12, dtype=torch.bool)
    padded[0, 0] = False
    refused = {
        "chunked (chunk 4)": _mask_kwargs(mask_function=mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))),
        "another window": _mask_kwargs(mask_function=mu.sliding_window_causal_mask_function(5)),
        "padding": _mask_kwargs(attention_mask=padded),
        "a cache before": _mask_kwargs(q_offset=3, kv_length=15),
        "keys past the queries": _mask_kwargs(kv_length=15),
        "a kv offset": _mask_kwargs(kv_offset=2),
        "packed or overlaid": _mask_kwargs(allow_is_causal_skip=False),
        "an or/and mask function": _mask_kwargs(use_vmap=True),
        "a full-attention layer": _mask_kwargs(local_size=None, mask_function=mu.causal_mask_function),
        "no q_offset argument": {k: v for k, v in _mask_kwargs().items() if k != "q_offset"},
    }  # fmt: skip
    assert {name: plain_window(kwargs) for name, kwargs in refused.items()} == dict.fromkeys(refused)


def test_causal_window_applies_only_a_window_that_hides_keys():
    q = torch.zeros(1, 2, 7, 4, dtype=torch.float64)
    assert bridge._causal_window(7, q, q, 0) is None  # 7 queries, window 7: plain causal hides as much
    assert bridge._causal_window(None, q, q, 0) is None
    mask = bridge._causal_window(3, q, q, 0)
    hf = mu.sdpa_mask(**_mask_kwargs(q_length=7, kv_length=7, mask_function=mu.sliding_window_causal_mask_function(3), local_size=3))  # fmt: skip
    assert torch.equal(mask.dense().reshape(7, 7), hf[0, 0])
    k = torch.zeros(
        1, 2, 10, 4, dtype=torch.float64
    )  # queries are the last 7 of 10 keys (Gemma 4's shared layers)
    hf = mu.sdpa_mask(**_mask_kwargs(q_length=7, kv_length=10, q_offset=3, mask_function=mu.sliding_window_causal_mask_function(3), local_size=3))  # fmt: skip
    assert torch.equal(bridge._causal_window(3, q, k, 3).dense().reshape(7, 10), hf[0, 0])


class _Spies:
    """The windows HF built dense through posenc's mask interface, and what posenc's ``attend`` got."""

    def __init__(self, monkeypatch):
        self.windows_built, self.attends = [], []
        interface = mu.ALL_MASK_ATTENTION_FUNCTIONS
        original_mask, original_attend = interface[posenc_hf.ATTN_IMPLEMENTATION], bridge.attend

        def mask(*args, **kwargs):
            built = original_mask(*args, **kwargs)
            if isinstance(built, torch.Tensor) and kwargs.get("local_size") is not None:
                self.windows_built.append(kwargs["local_size"])
            return built

        def attend(*args, **kwargs):
            self.attends.append((kwargs["mask"], kwargs["attn_mask"]))
            return original_attend(*args, **kwargs)

        monkeypatch.setitem(interface._local_mapping, posenc_hf.ATTN_IMPLEMENTATION, mask)
        monkeypatch.setattr(bridge, "attend", attend)

    def window_sizes(self):
        from posenc.masks.attention_mask import SlidingWindowMask

        return [
            c.window
            for m, _ in self.attends
            if m is not None
            for c in m.components
            if isinstance(c, SlidingWindowMask)
        ]


def _logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("with_ones_mask", [False, True])
def test_an_unpadded_gemma3_prefill_builds_no_dense_mask_for_its_sliding_layers(with_ones_mask, monkeypatch):
    model = _gemma3()
    ids = torch.randint(0, VOCAB, (2, LEN), generator=torch.Generator().manual_seed(1))
    kwargs = {"attention_mask": torch.ones(2, LEN, dtype=torch.long)} if with_ones_mask else {}
    want = _logits(model, "sdpa", ids, **kwargs)
    # The model's first posenc forward shows that its attention is handed sliding_window (until then
    # the window is built dense: a model like PhiMoE's would not get it, tests/test_hf_mask_reach.py).
    first = _Spies(monkeypatch)
    torch.testing.assert_close(_logits(model, "posenc", ids, **kwargs), want, **EXACT)
    assert first.windows_built == [WINDOW]
    spies = _Spies(monkeypatch)
    got = _logits(model, "posenc", ids, **kwargs)
    torch.testing.assert_close(got, want, **EXACT)
    assert spies.windows_built == []  # no dense window built
    assert [dense for _, dense in spies.attends] == [None, None, None]  # nor handed to posenc
    assert spies.window_sizes() == [WINDOW, WINDOW]  # the two sliding layers, as their window


def test_padded_and_packed_gemma3_batches_keep_hf_s_dense_window(monkeypatch):
    model = _gemma3()
    ids = torch.randint(0, VOCAB, (2, LEN), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, LEN, dtype=torch.long)
    padded[1, :4] = 0
    packed = torch.cat([torch.arange(10), torch.arange(LEN - 10)])[None].expand(2, -1)
    # (HF reads restarting position_ids as packed documents only without a cache)
    for kwargs in ({"attention_mask": padded}, {"position_ids": packed, "use_cache": False}):
        want = _logits(model, "sdpa", ids, **kwargs)
        spies = _Spies(monkeypatch)
        got = _logits(model, "posenc", ids, **kwargs)
        real = kwargs.get("attention_mask", torch.ones(2, LEN)).bool()
        torch.testing.assert_close(got[real], want[real], **EXACT)
        assert WINDOW in spies.windows_built  # HF built the window's dense mask: posenc used it
        assert spies.window_sizes() == []


def test_decoding_after_an_unbuilt_window_prefill_equals_hf():
    """The prefill's None mask fills HF's sliding cache; the decode steps after it get HF's masks."""
    model = _gemma3()
    ids = torch.randint(0, VOCAB, (1, LEN), generator=torch.Generator().manual_seed(2))
    steps = {}
    for impl in ("sdpa", "posenc"):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :12], use_cache=False)  # shows the window reaches the attention: the next is unbuilt
            out = [model(ids[:, :12], past_key_values=cache, use_cache=True).logits]
            for t in range(12, LEN):
                out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        steps[impl] = torch.cat(out, dim=1)
    torch.testing.assert_close(steps["posenc"], steps["sdpa"], **EXACT)
