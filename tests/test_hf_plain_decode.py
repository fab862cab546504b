"""The HF bridge's plain decode step (``posenc.hf._attention._plain_decode``): one query on CPU
without gradients, no mask, bias, sinks or window, whose signature the dispatcher answered with
sdpa, runs without building a request. It must give the full path's logits bit for bit, still send
a nan in the new tokens (or in the cache) to a backend that propagates it, and follow a forced
backend or a new priority order at once.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
import posenc  # noqa: E402
import posenc.hf as posenc_hf  # noqa: E402
from posenc.backends.dispatch import PRIORITY, set_priority  # noqa: E402
from posenc.hf import _attention as bridge  # noqa: E402

VOCAB = 50


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    posenc_hf.register()
    yield


def _llama(num_kv_heads: int = 2, dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    return model


def _served(monkeypatch) -> list[bool]:
    """One entry per layer call: whether the plain decode step served it."""
    served: list[bool] = []
    real = bridge._plain_decode
    monkeypatch.setattr(bridge, "_plain_decode", lambda *a: served.append(True) or real(*a))
    return served


def _decode(model, ids: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    """The logits of a prompt, then of one token at a time."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return logits


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_decode_step_gives_the_full_path_s_logits_bit_for_bit(num_kv_heads, dtype, monkeypatch):
    model = _llama(num_kv_heads, dtype)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    served = _served(monkeypatch)
    fast = _decode(model, ids, 5)
    assert len(served) >= 2 * 5, "the plain decode step served the later steps"
    with monkeypatch.context() as full:
        full.setattr(bridge, "_plain_call", lambda *a: None)
        want = _decode(model, ids, 5)
    for got, expected in zip(fast, want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("where", ["query", "new key", "new value"])
def test_a_nan_in_a_plain_decode_step_goes_to_eager_and_stays_nan(where, monkeypatch):
    model = _llama()
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = transformers.DynamicCache(config=model.config)
    layer = model.model.layers[1].self_attn
    projection = {"query": layer.q_proj, "new key": layer.k_proj, "new value": layer.v_proj}[where]
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        served = _served(monkeypatch)
        for t in (5, 6):  # the first remembers the signature, the second is served plainly
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        assert served and posenc_hf.last_backend() == "sdpa"
        handle = projection.register_forward_hook(
            lambda m, i, out: out.index_fill(-1, torch.tensor([0]), torch.nan)
        )
        out = model(ids[:, 7:8], past_key_values=cache, use_cache=True).logits
        handle.remove()
        assert not torch.isfinite(out).any() and posenc_hf.last_backend() == "eager"
        if where != "query":  # the nan now sits in layer 1's cache: every later step there is eager
            out = model(ids[:, 8:9], past_key_values=cache, use_cache=True).logits
            assert not torch.isfinite(out).any() and posenc_hf.last_backend() == "eager"


def test_a_forced_backend_and_a_new_order_take_effect_on_the_next_plain_step(monkeypatch):
    model = _llama()
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = transformers.DynamicCache(config=model.config)
    before = PRIORITY["cpu"]

    def step(t: int) -> str:
        model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        return posenc_hf.last_backend()

    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        assert step(5) == step(6) == "sdpa"
        with posenc.use_backend("eager"):
            assert step(7) == "eager"
        assert step(8) == "sdpa"
        try:
            set_priority("cpu", ("eager", *(n for n in before if n != "eager")))
            assert step(9) == "eager"
        finally:
            set_priority("cpu", before)
        assert step(10) == "sdpa"


def test_gradients_masks_and_windows_take_the_full_path(monkeypatch):
    """The plain step serves no call that needs more than sdpa over every key: under grad, with a
    padding mask, or in a layer that names a sliding window."""
    model = _llama()
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(6))
    served = _served(monkeypatch)
    cache = transformers.DynamicCache(config=model.config)
    model(ids[:, :5], past_key_values=cache, use_cache=True)
    for t in (5, 6):  # grad enabled
        model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    assert served == []
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 0] = 0
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True)
        for t in (5, 6):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True)
    assert served == []


def test_keys_inserted_before_the_new_one_are_checked(monkeypatch):
    """The plain step links a call to the last one only when exactly one key was added: keys put
    into a cache by other means (here one whose key repeats the last checked one, so the keys
    before the new token still end as the last call's did, and whose value holds a nan) are read
    by the full path's check, which sends the call to eager."""
    model = _llama()
    module = model.model.layers[0].self_attn
    torch.manual_seed(8)
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)

    def call(k: torch.Tensor, v: torch.Tensor) -> str:
        bridge.attention_forward(module, q, k, v, None, scaling=0.25)
        return posenc_hf.last_backend()

    served = _served(monkeypatch)
    with torch.no_grad():
        for _ in range(3):  # the first remembers the signature, the next are served plainly
            k, v = torch.cat([k, torch.randn(1, 2, 1, 16)], 2), torch.cat([v, torch.randn(1, 2, 1, 16)], 2)
            assert call(k, v) == "sdpa"
        assert len(served) == 2
        inserted_v = torch.full((1, 2, 1, 16), float("nan"))
        k = torch.cat([k, k[:, :, -1:], torch.randn(1, 2, 1, 16)], 2)
        v = torch.cat([v, inserted_v, torch.randn(1, 2, 1, 16)], 2)
        assert call(k, v) == "eager"


def test_values_of_another_width_are_served_bit_for_bit(monkeypatch):
    """MLA's values are narrower than its queries and keys: the plain step tests the three apart and
    gives the full path's output."""
    model = _llama()
    module = model.model.layers[0].self_attn
    torch.manual_seed(9)
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 8)
    steps = [(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 8)) for _ in range(4)]

    def decode() -> list[torch.Tensor]:
        keys, values, outs = k, v, []
        with torch.no_grad():
            for new_k, new_v in steps:
                keys, values = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
                outs.append(bridge.attention_forward(module, q, keys, values, None, scaling=0.25)[0])
        return outs

    served = _served(monkeypatch)
    got = decode()
    assert len(served) == 3 and posenc_hf.last_backend() == "sdpa"
    bridge._CHECKED.pop(module, None)
    with monkeypatch.context() as full:
        full.setattr(bridge, "_plain_call", lambda *a: None)
        want = decode()
    for out, expected in zip(got, want, strict=True):
        assert out.shape == (1, 1, 4, 8) and torch.equal(out, expected)
