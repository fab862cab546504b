"""One plain decode step for the eager layer and the HF bridge (``posenc.layers.plain_step``).

Both callers key their shortcut on one signature form (their call's fields, then
``posenc.backends.dispatch_state``), remember it per module only after a full call served it on sdpa
with finite values, and run the same nan test and the same sdpa call. Neither reads the dispatcher's
memo module, and the position tensors' version marks have one owner (``kernels.position_ranges``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import posenc
from posenc.backends import dispatch_state, register_backend
from posenc.backends.dispatch import PRIORITY, set_priority
from posenc.layers import plain_step

SRC = pathlib.Path(posenc.__file__).parent


def _count_calls(monkeypatch) -> dict[str, int]:
    """Count calls of the shared step's nan test and kernel, by whichever caller."""
    calls = {"fresh_finite": 0, "attend": 0}
    for name in calls:
        real = getattr(plain_step, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(plain_step, name, counted)
    return calls


def test_the_eager_layer_s_plain_steps_run_the_shared_nan_test_and_kernel(monkeypatch):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, encoding="rope", causal=True).eval()
    cache = posenc.KVCache()
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        layer(torch.randn(1, 5, 32), cache=cache)
        layer(torch.randn(1, 1, 32), cache=cache)  # the full path: remembers the signature
        assert plain_step.remembered(layer) is not None
        for _ in range(3):
            layer(torch.randn(1, 1, 32), cache=cache)
    assert calls == {"fresh_finite": 3, "attend": 3}


def test_the_hf_bridge_s_plain_steps_run_the_same_nan_test_and_kernel(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import posenc.hf as posenc_hf

    posenc_hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    calls = _count_calls(monkeypatch)
    ids = torch.randint(0, 50, (1, 9))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        for t in range(5, 9):  # the first step of each layer is full, the next three plain
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    attention = model.model.layers[0].self_attn
    assert plain_step.remembered(attention) is not None
    assert calls == {"fresh_finite": 2 * 3, "attend": 2 * 3}


def test_the_dispatcher_state_changes_with_everything_that_changes_a_choice():
    before = dispatch_state("auto")
    assert before == dispatch_state("auto")
    assert dispatch_state("eager")[0] == "eager" and dispatch_state("eager") != before
    with posenc.use_backend("eager"):
        assert dispatch_state("auto")[0] == "eager"
    order = list(PRIORITY["cpu"])
    try:
        set_priority("cpu", [*order[1:], order[0]])
        assert dispatch_state("auto") != before
    finally:
        set_priority("cpu", order)
    generation = dispatch_state("auto")[1]
    register_backend(posenc.backends.get_backend("eager"))  # a registration, even of the same backend
    assert dispatch_state("auto")[1] > generation


def test_a_layer_remembers_only_a_call_served_on_sdpa_with_finite_values():
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, encoding="rope", causal=True, backend="eager").eval()
    cache = posenc.KVCache()
    with torch.no_grad():
        layer(torch.randn(1, 4, 32), cache=cache)
        layer(torch.randn(1, 1, 32), cache=cache)
    assert layer.last_backend == "eager"
    assert plain_step.remembered(layer) is None


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
            names.update(f"{'.' * node.level}{node.module or ''}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("module", ["layers/plain_step.py", "hf/_attention.py", "layers/attention.py"])
def test_no_caller_of_the_plain_step_reads_the_dispatcher_s_memo(module):
    imported = _imports(SRC / module)
    assert not any(name.endswith("memo") or ".memo." in name for name in imported), imported


def _reads_version_counter(path: pathlib.Path) -> bool:
    return any(
        isinstance(node, ast.Attribute) and node.attr == "_version"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_only_position_ranges_reads_a_position_tensor_s_version_counter():
    """The HF bridge kept its own versioned ``arange`` table; it now asks ``counting_positions``. The
    cache reads the version of a cross-attention context (its identity), not of positions."""
    readers = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if _reads_version_counter(path))
    assert readers == ["cache/entry.py", "kernels/position_ranges.py"], readers
