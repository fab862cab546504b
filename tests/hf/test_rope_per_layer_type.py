"""posenc.hf.set_rope_scaling on models whose RoPE is given per layer type (issue 58, item 5): scaling
only the full-attention layers equals HF's own model loaded with that per-type ``rope_parameters``,
on tiny random configs of every family HF ships with per-layer-type RoPE that builds here (Gemma 3's
global layers, Olmo 3's full-attention layers, ...); the sliding layers keep their RoPE; a flat dict
on such a model, a per-type dict on a model without types, an unknown type and a type without RoPE
are refused by name, leaving the model as it was."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

import posenc.hf as posenc_hf  # noqa: E402

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=64,
)  # fmt: skip
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
#: Families whose HF config keys ``rope_parameters`` by ``layer_types`` (each skipped at a release without it).
#: Dory is left out: its own forward fails on a tiny config (a mask of 47 keys for 40 at 5.24).
FAMILIES = ["gemma3_text", "olmo3", "gemma4_text", "mimo_v2_flash", "mellum", "laguna"]
SCALINGS = [
    {"rope_type": "linear", "factor": 8.0},  # Gemma 3's global layers
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # Olmo 3's full layers
]


def _config(family, full=None):
    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    config = CONFIG_MAPPING[family](**TINY, layer_types=list(TYPES))
    if full is not None:
        theta = config.rope_parameters["full_attention"]["rope_theta"]
        config.rope_parameters = {**config.rope_parameters, "full_attention": {"rope_theta": theta, **full}}
    return config


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("scaling", SCALINGS, ids=["linear", "yarn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_scaling_the_full_attention_layers_equals_hf_loaded_with_it(family, scaling):
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(_config(family)).eval()
    loaded = AutoModelForCausalLM.from_config(_config(family, scaling)).eval()
    loaded.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 128, (2, 40))
    unscaled = _logits(plain, ids)
    sliding = copy.deepcopy(plain.config.rope_parameters["sliding_attention"])
    posenc_hf.set_rope_scaling(plain, {"full_attention": dict(scaling)})
    torch.testing.assert_close(_logits(plain, ids), _logits(loaded, ids), rtol=0, atol=1e-6)
    assert not torch.allclose(_logits(plain, ids), unscaled)  # the scaling bites
    assert plain.config.rope_parameters["sliding_attention"] == sliding  # the window layers keep theirs


def test_a_scaling_in_the_wrong_form_or_for_a_missing_type_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("gemma3_text")).eval()
    before = copy.deepcopy(model.config.rope_parameters)
    rotary = model.model.rotary_emb
    with pytest.raises(
        ValueError, match=r"Gemma3ForCausalLM has RoPE per layer type \(sliding_attention, full_attention\)"
    ):
        posenc_hf.set_rope_scaling(model, {"rope_type": "linear", "factor": 8.0})
    with pytest.raises(
        ValueError, match=r"has no layer type 'chunked_attention'; its types: sliding_attention"
    ):
        posenc_hf.set_rope_scaling(model, {"chunked_attention": {"rope_type": "linear", "factor": 8.0}})
    with pytest.raises(ValueError, match=r"set_rope_scaling\['full_attention'\]: .*factor"):
        posenc_hf.set_rope_scaling(model, {"full_attention": {"rope_type": "linear"}})
    assert model.config.rope_parameters == before and model.model.rotary_emb is rotary
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "sliding_window"})
    )
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has one RoPE for every layer"):
        posenc_hf.set_rope_scaling(llama, {"full_attention": {"rope_type": "linear", "factor": 8.0}})


def test_a_type_without_rope_is_refused_by_name():
    if "beam" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no beam")
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["beam"](**TINY)).eval()
    if model.config.rope_parameters.get("full_attention") is not None:
        pytest.skip("this release of beam has RoPE on its full-attention layers")
    with pytest.raises(ValueError, match=r"'full_attention' layers have no RoPE to scale \(NoPE\)"):
        posenc_hf.set_rope_scaling(model, {"full_attention": {"rope_type": "linear", "factor": 8.0}})


def test_the_studys_scaling_variants_rescale_the_global_layers_only_as_hf_loaded_with_them():
    """The study's yarn and ntk variants on a Gemma 3: its full-attention layers scaled, each over its own
    base, the sliding ones untouched; equal to HF's model loaded with that per-type config; ``none``
    puts every type back."""
    from posenc.experiments.study.hf_methods import apply_variant
    from posenc.experiments.study.hf_scaling import ntk_parameters
    from posenc.experiments.study.plan import plan_study

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("gemma3_text")).eval()
    original = copy.deepcopy(model.config.rope_parameters)
    ids = torch.randint(0, 128, (1, 50))
    plain = _logits(model, ids)
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    apply_variant(model, yarn, original)
    assert model.config.rope_parameters["sliding_attention"] == original["sliding_attention"]
    loaded = AutoModelForCausalLM.from_config(_config("gemma3_text", yarn)).eval()
    loaded.load_state_dict(model.state_dict())
    torch.testing.assert_close(_logits(model, ids), _logits(loaded, ids), rtol=0, atol=1e-6)
    # ntk: the full-attention layers' base raised from their own theta (1e6 here), not the sliding ones'
    apply_variant(model, {"rope_type": "ntk", "factor": 2.0}, original)
    expected = ntk_parameters(model.config, original["full_attention"], 2.0)["rope_theta"]
    assert model.config.rope_parameters["full_attention"]["rope_theta"] == expected
    assert expected > original["full_attention"]["rope_theta"] != original["sliding_attention"]["rope_theta"]
    apply_variant(model, None, original)
    assert model.config.rope_parameters == original
    torch.testing.assert_close(_logits(model, ids), plain, rtol=0, atol=0)
    plan = plan_study(
        model.config, "Gemma3ForCausalLM", "tiny-gemma", task="text-lm", variants=["none", "yarn"]
    )
    assert plan.settings["scaled_layer_types"] == ["full_attention"]


def test_a_method_on_a_hybrid_model_acts_on_its_full_attention_layers_and_keeps_the_window_layers_rope():
    """Self-Extend on a Gemma 3: the full-attention layers get the method over their own base (1e6), the
    sliding layers their own RoPE (base 1e4); at a setting that moves no position (written out: the study
    refuses it by name) the logits are HF's own, with the real setting they are HF's inside the
    neighbour window and differ past it; ``none`` puts the model back exactly."""
    from posenc.encodings.rope import RoPE
    from posenc.experiments.study.hf_methods import apply_variant, method_parameters

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("gemma3_text")).eval()
    original = copy.deepcopy(model.config.rope_parameters)
    ids = torch.randint(0, 128, (1, 100))
    hf = _logits(model, ids)
    entry = method_parameters("self_extend:group_size=2,neighbor_window=16", model.config, 64, 128)
    assert entry["rope_parameters"]["rope_theta"] == original["full_attention"]["rope_theta"]
    assert entry["kept_rope"] == {"sliding_attention": original["sliding_attention"]}
    plain = {**entry, "options": {"group_size": 1, "neighbor_window": 16}}
    apply_variant(model, plain, original)
    torch.testing.assert_close(_logits(model, ids), hf, rtol=0, atol=1e-5)
    apply_variant(model, entry, original)
    for layer, layer_type in zip(model.model.layers, TYPES):
        encoding = layer.self_attn.posenc_encoding
        if layer_type == "sliding_attention":
            base = original["sliding_attention"]["rope_theta"]  # inv_freq[1] = base^(-2/d), d = 16
            assert isinstance(encoding, RoPE)
            assert float(encoding.tables.inv_freq[1]) == pytest.approx(base ** (-2 / 16), rel=1e-6)
        else:
            assert not isinstance(encoding, RoPE)
    got = _logits(model, ids)
    torch.testing.assert_close(got[:, :16], hf[:, :16], rtol=0, atol=1e-5)
    assert not torch.allclose(got[:, 40:], hf[:, 40:], atol=1e-3)
    apply_variant(model, None, original)
    torch.testing.assert_close(_logits(model, ids), hf, rtol=0, atol=0)


@pytest.mark.parametrize("rope_type", ["yarn", "llama3"])
def test_a_scaling_without_its_pretraining_length_takes_the_configs_as_hf_does(rope_type):
    """Issue 62 item 11: HF's standardize_rope_params fills original_max_position_embeddings from the
    config for llama3, yarn and longrope; set_rope_scaling refused that dict where HF loads it."""
    extra = {"low_freq_factor": 1.0, "high_freq_factor": 4.0} if rope_type == "llama3" else {}
    given = {"rope_type": rope_type, "factor": 4.0, **extra}
    base = {k: v for k, v in TINY.items() if k != "sliding_window"}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()
    theta = model.config.rope_parameters["rope_theta"]
    loaded = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**base, rope_parameters={"rope_theta": theta, **given})
    ).eval()
    loaded.load_state_dict(model.state_dict())
    assert (
        loaded.config.rope_parameters["original_max_position_embeddings"] == TINY["max_position_embeddings"]
    )
    posenc_hf.set_rope_scaling(model, dict(given))
    assert model.config.rope_parameters["original_max_position_embeddings"] == TINY["max_position_embeddings"]
    ids = torch.randint(0, 128, (1, 50))
    torch.testing.assert_close(_logits(model, ids), _logits(loaded, ids), rtol=0, atol=1e-6)
