"""What each extension recipe changes, against definitions written out here or HF's RoPE functions.

PI, NTK and YaRN: the continued model's inverse frequencies (and YaRN's attention factor) equal HF's
``ROPE_INIT_FUNCTIONS`` / the NTK base formula at ``s = L2 / L`` in tokens, over the run's length.
ABF: ``1 / B^(2i/d)``. ``layers=long``: Gemma 3's window layers keep their frequencies.
``interpolate_table``: row ``r`` is the trained table linearly interpolated at
``x = (r + 0.5)·n/N − 0.5`` clamped to ``[0, n − 1]`` (``align_corners=False``).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from posenc.experiments.config import ExperimentConfig, RunSpec
from posenc.experiments.extension.recipes import (
    RecipeContext,
    parse_recipes,
    recipe_layers,
    resample_table_rows,
)
from posenc.experiments.extension.stage import ExtensionConfig, _recipe_model, _training_config

HEAD_DIM = 8
BASE = ExperimentConfig(task="copy", train_len=6, eval_len=8, d_model=16, num_heads=2, d_ff=32, num_layers=2)
TASK = BASE.make_task()
CTX = RecipeContext(TASK.sequence_length(6), TASK.sequence_length(12), HEAD_DIM)


def _model(encoding: str, recipe_text: str, num_layers: int = 2):
    base = ExperimentConfig(**{**BASE.to_dict(), "num_layers": num_layers})
    ext = ExtensionConfig(to_len=12, recipes=[recipe_text], steps=3).resolved(base)
    (recipe,) = parse_recipes(recipe_text)
    train = _training_config(base, ext, recipe)
    return _recipe_model(base, train, TASK, RunSpec(encoding, 0), recipe, CTX, None, None)


def _rope_layers(model):
    return [block.attn.encoding for block in model.blocks]


def _hf_inv_freq(rope_type: str, **params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(
            hidden_size=2 * HEAD_DIM,
            num_attention_heads=2,
            head_dim=HEAD_DIM,
            max_position_embeddings=CTX.target_tokens,
            rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **params},
        )
    return ROPE_INIT_FUNCTIONS[rope_type](config)


@pytest.mark.parametrize(
    ("recipe", "rope_type", "params"),
    [
        ("pi", "linear", {}),
        ("yarn", "yarn", {"original_max_position_embeddings": CTX.train_tokens}),
        ("pose:scaling=yarn", "yarn", {"original_max_position_embeddings": CTX.train_tokens}),
        ("cream:scaling=pi", "linear", {}),
    ],
)
def test_scaling_recipes_give_hfs_frequencies_at_the_token_ratio(recipe, rope_type, params):
    factor = TASK.sequence_length(12) / TASK.sequence_length(6)
    want, attention = _hf_inv_freq(rope_type, factor=factor, **params)
    for layer in _rope_layers(_model("rope", recipe)):
        torch.testing.assert_close(layer.inv_freq, want.float(), rtol=1e-6, atol=0)
        assert layer.attention_scale == pytest.approx(attention, rel=1e-6)


def test_ntk_raises_the_base_by_the_ntk_formula():
    s = CTX.factor
    base = 10000.0 * s ** (HEAD_DIM / (HEAD_DIM - 2))
    want = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    for layer in _rope_layers(_model("rope", "ntk")):
        torch.testing.assert_close(layer.inv_freq.double(), want, rtol=1e-6, atol=0)


def test_abf_sets_the_base():
    want = 1.0 / 5e5 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    for layer in _rope_layers(_model("rope:base=100", "abf:base=5e5")):
        torch.testing.assert_close(layer.inv_freq.double(), want, rtol=1e-6, atol=0)


def test_long_layers_only_leaves_the_window_layers_as_trained():
    """Gemma 3's layout: five window layers and one global; ``layers=long`` scales the global only."""
    plain = _rope_layers(_model("gemma3:window=4", "continue", num_layers=6))
    scaled = _rope_layers(_model("gemma3:window=4", "yarn:layers=long", num_layers=6))
    everywhere = _rope_layers(_model("gemma3:window=4", "yarn", num_layers=6))
    for i in range(5):
        torch.testing.assert_close(scaled[i].inv_freq, plain[i].inv_freq, rtol=0, atol=0)
        assert not torch.equal(everywhere[i].inv_freq, plain[i].inv_freq)
    assert not torch.equal(scaled[5].inv_freq, plain[5].inv_freq)
    torch.testing.assert_close(scaled[5].inv_freq, everywhere[5].inv_freq, rtol=0, atol=0)


def _written_out_resample(table: torch.Tensor, rows: int) -> torch.Tensor:
    n = table.shape[0]
    out = torch.empty(rows, table.shape[1], dtype=torch.float64)
    for r in range(rows):
        x = min(max((r + 0.5) * n / rows - 0.5, 0.0), n - 1)
        lo = math.floor(x)
        hi = min(lo + 1, n - 1)
        out[r] = table[lo].double() * (1 - (x - lo)) + table[hi].double() * (x - lo)
    return out


@pytest.mark.parametrize(("n", "rows"), [(1, 5), (7, 13), (14, 26), (5, 5)])
def test_table_rows_resample_as_written_out(n, rows):
    table = torch.randn(n, 3, dtype=torch.float64)
    torch.testing.assert_close(resample_table_rows(table, rows), _written_out_resample(table, rows))


def test_interpolate_table_changes_the_learned_rows_up_to_the_target():
    model = _model("learned", "interpolate_table")
    (table,) = [m for m in model.modules() if type(m).__name__ == "Learned"]
    fresh = _model("learned", "continue")
    (before,) = [m for m in fresh.modules() if type(m).__name__ == "Learned"]
    want = _written_out_resample(before.table.weight[: CTX.train_tokens], CTX.target_tokens).float()
    torch.testing.assert_close(table.table.weight[: CTX.target_tokens], want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        table.table.weight[CTX.target_tokens :], before.table.weight[CTX.target_tokens :]
    )


@pytest.mark.parametrize(
    ("encoding", "recipe", "message"),
    [
        ("alibi", "pi", "'pi' does not apply to 'alibi'"),
        ("t5", "abf:base=1e6", "'abf:base=1e6' does not apply to 't5'"),
        ("rope", "interpolate_table", "'interpolate_table' does not apply to 'rope'"),
        ("alibi", "pose:scaling=yarn", "does not apply to 'alibi'"),
    ],
)
def test_a_recipe_that_cannot_apply_is_refused_by_name(encoding, recipe, message):
    with pytest.raises(ValueError, match=message):
        _model(encoding, recipe)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stretch", "unknown recipe"),
        ("abf", "needs base=VALUE"),
        ("abf:base=-3", "base='-3' must be positive"),
        ("pi:factor=0.5", "must be at least 1"),
        ("pose:chunks=1", "chunks='1' must be at least 2"),
        ("pose:factor=2", "give scaling=pi, ntk or yarn too"),
        ("yarn:layers=some", "must be all or long"),
        ("continue:steps=3", "continue has no option steps"),
        ("pi,pi", "lists pi twice"),
    ],
)
def test_bad_recipes_are_refused_naming_the_item(text, message):
    with pytest.raises(ValueError, match=message):
        parse_recipes(text)


def test_a_recipe_keeps_the_options_it_does_not_replace():
    (recipe,) = parse_recipes("yarn:factor=4")
    encoding, pattern = recipe_layers("rope:base=500,pairing=interleaved/alibi", 2, recipe, CTX)
    assert pattern is None
    first, second = encoding.split("/")
    assert "base=500" in first and "pairing=interleaved" in first and "factor=4" in first
    assert second == "alibi"
