"""One grammar for spec strings (posenc.encodings.spec): the same string parses the same way at every entry
point, options stay with their encoding, and a spec is parsed once.

The grammar lives in :mod:`posenc.encodings.spec` (``name:key=value,...``, hybrids joined by ``/``, lists of
specs separated by ``,``); the command line, the experiment config, the model, the inference-time
variants and the layer presets all read spec strings through it.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.encodings.registry import resolve
from posenc.encodings.spec import LAYER_SEPARATOR, Spec, parse_spec, split_layers, split_specs
from posenc.experiments import ExperimentConfig
from posenc.experiments.train import build_model
from posenc.experiments.variants import parse_eval_variants, variant_context, variant_encoding
from posenc.layers.patterns import gemma3, is_layer_preset, layer_pattern

# Written by hand: what each piece of the grammar gives for these strings.
LIST = " nope , rope:base=500000, pairing=half ,t5 / alibi,, gemma3:window=8,global_every=2"

SPECS = ["nope", "rope:base=500000,pairing=half", "t5 / alibi", "gemma3:window=8,global_every=2"]

HYBRID_LAYERS = ["t5", "alibi"]


def test_the_grammar_itself():
    assert split_specs(LIST) == SPECS
    assert split_layers(SPECS[2]) == HYBRID_LAYERS and LAYER_SEPARATOR == "/"
    assert parse_spec(" rope : base = 500000 , pairing=half ") == (
        "rope",
        {"base": "500000", "pairing": "half"},
    )
    assert parse_spec(SPECS[3]) == ("gemma3", {"window": "8", "global_every": "2"})


def test_the_command_line_reads_encodings_with_the_grammar():
    pytest.importorskip("typer")
    from posenc.cli.experiments import CONFIG_OPTIONS

    (option,) = [option for option in CONFIG_OPTIONS if option.name == "encodings"]
    assert option.value(LIST) == SPECS


def test_the_experiment_model_reads_a_hybrid_with_the_grammar():
    config = ExperimentConfig(task="copy", d_model=8, num_heads=2, num_layers=2, d_ff=8, num_symbols=4)
    with torch.device("meta"):
        model = build_model(config, config.make_task(), SPECS[2])
    assert [block.attn.encoding.name for block in model.blocks] == HYBRID_LAYERS
    with torch.device("meta"):
        model = build_model(config, config.make_task(), "rope : base=500000, pairing=half")
    for block in model.blocks:
        options = block.attn.encoding.config()
        assert block.attn.encoding.name == "rope" and (options["base"], options["pairing"]) == (
            500000.0,
            "half",
        )


def test_variants_read_a_hybrid_with_the_grammar():
    config = ExperimentConfig(task="copy", train_len=4, eval_len=8, d_model=8, num_heads=2)
    (variant,) = parse_eval_variants(["prope:0.5"])
    changed = variant_encoding("rope:base=100 / alibi", variant, variant_context(config, config.make_task()))
    layers = split_layers(changed)
    assert layers[1] == "alibi"
    name, raw = parse_spec(layers[0])
    # p-RoPE 0.5 of head_dim 8 / 2 = 4: two rotated dimensions, added to the layer's own options.
    assert (name, raw) == ("rope", {"base": "100", "scaling": "proportional", "rotary_dim": "2"})


def test_layer_presets_read_the_same_grammar():
    text = SPECS[3]
    assert is_layer_preset(text) and not is_layer_preset(SPECS[1])
    _, raw = parse_spec(text)
    assert layer_pattern(text, 6) == gemma3(6, **{key: int(value) for key, value in raw.items()})


# ----------------------------------------------------------------------------
# One contract per kind: the kind bases checked by ``@register``, the LayerContext a layer hands its
# encoding, derived float32 buffers that survive casts, ``to_empty()`` and meta-device construction, the one
# RoPE cos/sin cache, the scaling registry's examples and the parsed :class:`Spec`.


# ---------------------------------------------------------------------------- Spec


def test_resolve_parses_once_into_a_spec():
    spec = resolve("t5:num_buckets=16,bidirectional=false")
    assert isinstance(spec, Spec) and spec.cls is posenc.get_class("t5")
    assert spec.options == {"num_buckets": 16, "bidirectional": False}
    assert str(spec) == "t5:num_buckets=16,bidirectional=False"
    assert posenc.build(spec, num_heads=2).config()["num_buckets"] == 16


def test_a_model_parses_each_spec_string_once(monkeypatch):
    from posenc.encodings import registry

    calls = []
    original = registry.parse_spec
    monkeypatch.setattr(registry, "parse_spec", lambda text: calls.append(text) or original(text))
    posenc.TransformerLM(7, 32, 4, 2, ["t5", "t5", "alibi", "alibi"], max_len=16)
    assert sorted(calls) == ["alibi", "t5"]


# ----------------------------------------------------------------------------
# The extrapolation runner: records for every task, the exact-match metric, outputs and the CLI.


def test_split_specs_keeps_options_with_their_encoding():
    assert split_specs("nope,rope:base=500000,pairing=half,alibi") == [
        "nope",
        "rope:base=500000,pairing=half",
        "alibi",
    ]
    assert split_specs(" t5 , shaw:k=4 ") == ["t5", "shaw:k=4"]
