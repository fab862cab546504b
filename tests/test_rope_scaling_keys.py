"""RoPE scaling: the pretraining length is required, and keys a type does not read are refused.

Issue 49 item 3. Expected behaviour from HF transformers' ``modeling_rope_utils``: its validation
(``_check_received_keys``) raises a KeyError for a missing required key (yarn: ``factor`` and
``original_max_position_embeddings``; llama3 and longrope: ``original_max_position_embeddings``),
and its compute functions index ``original_max_position_embeddings``. Real configs' dicts (built
with HF's own config classes, no downloads) must still build, with HF's frequencies.
"""

from __future__ import annotations

import pytest
import torch

import posenc
import posenc.functional as F

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402


def test_yarn_without_factor_or_pretraining_length_is_an_error():
    """The issue's case: it gave the default frequencies and scale 1.0; HF raises a KeyError."""
    with pytest.raises(KeyError, match="factor"):  # HF refuses the same dict
        transformers.LlamaConfig(rope_parameters={"rope_type": "yarn"}, max_position_embeddings=2048)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        F.rope_inv_freq(128, 1e4, {"rope_type": "yarn", "max_position_embeddings": 2048})


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "max_position_embeddings": 8192},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "max_position_embeddings": 8192,
        },
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "max_position_embeddings": 64,
        },
    ],
    ids=["yarn", "llama3", "longrope"],
)
def test_the_model_length_does_not_stand_in_for_the_pretraining_length(scaling):
    """README: leaving original_max_position_embeddings out "is an error, not a guess"."""
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        F.rope_inv_freq(8, 1e4, scaling)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        posenc.build("rope", head_dim=8, rope_parameters=scaling)


def test_an_option_of_another_type_is_refused_naming_it_and_the_accepted_keys():
    """``short_factor`` on yarn was dropped without a word."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    for build in (
        lambda: F.rope_inv_freq(8, 1e4, {**yarn, "short_factor": [1.0] * 4}),
        lambda: posenc.build("rope", head_dim=8, rope_parameters={**yarn, "short_factor": [1.0] * 4}),
        lambda: posenc.build(
            "rope:scaling=yarn,factor=4,original_max_position_embeddings=64,short_factor=1|1|1|1", head_dim=8
        ),
    ):
        with pytest.raises(ValueError, match=r"'yarn' does not take 'short_factor'.*beta_fast"):
            build()


def test_a_key_no_one_reads_is_refused():
    """Phi-3.5-MoE's ``short_mscale`` changes HF's attention scale; posenc does not read it, so it is refused."""
    longrope = {
        "rope_type": "longrope",
        "original_max_position_embeddings": 16,
        "factor": 4.0,
        "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4,
        "short_mscale": 1.24,
    }
    with pytest.raises(ValueError, match="'short_mscale'"):
        posenc.build("rope", head_dim=8, rope_parameters=longrope)


def test_an_option_left_at_none_is_not_given():
    F.rope_inv_freq(8, 1e4, {"rope_type": "linear", "factor": 2.0, "beta_fast": None})


def _hf_frequencies(config, layer_type=None):
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / base ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim), 1.0
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)


def _tiny(cls, **options):
    sizes = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2}
    return cls(**sizes, **options)


@pytest.mark.parametrize(
    "make",
    [
        # Llama 3.1: llama3 scaling, rope_theta inside rope_parameters (transformers 5).
        lambda: _tiny(
            transformers.LlamaConfig,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        lambda: _tiny(transformers.LlamaConfig, rope_theta=100000.0),  # SmolLM2
        # Qwen2.5 long-context card: the legacy "type" beside HF's added "rope_type".
        lambda: _tiny(
            transformers.Qwen2Config,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        ),
        # Ministral 3: llama_4_scaling_beta and max_position_embeddings inside rope_parameters.
        lambda: _tiny(transformers.Ministral3Config),
    ],
    ids=["llama3.1", "smollm2", "qwen2.5-yarn", "ministral3"],
)
def test_real_configs_build_with_hf_frequencies(make):
    config = make()
    want, scale = _hf_frequencies(config)
    rope = posenc.build(
        "rope",
        head_dim=config.head_dim,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
    )
    torch.testing.assert_close(rope.inv_freq, want.float(), rtol=1e-6, atol=0)
    assert rope.attention_scale == pytest.approx(scale)


def test_gemma3_per_layer_dicts_build():
    config = _tiny(
        transformers.Gemma3TextConfig,
        num_hidden_layers=2,
        intermediate_size=32,
        vocab_size=32,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    for layer_type in ("sliding_attention", "full_attention"):
        want, _ = _hf_frequencies(config, layer_type)
        params = dict(config.rope_parameters[layer_type])
        rope = posenc.build("rope", head_dim=16, rope_parameters=params)
        torch.testing.assert_close(rope.inv_freq, want.float(), rtol=1e-6, atol=0)


def test_qwen2_vl_sections_pass_to_mrope():
    """``mrope_section`` is read by M-RoPE, not by the frequencies: HF ignores it at validation too."""
    params = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    enc = posenc.build("mrope", head_dim=16, rope_parameters=params)
    assert enc.mrope_section == [2, 3, 3]
