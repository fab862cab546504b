"""The piecewise-RoPE methods of ``--eval-variants`` on a pretrained model (posenc.experiments.study.hf_methods;
issue 45, items 4 and 5): the defaults each paper advises from the context ``c`` and ``--eval-len`` ``E``
(formulas written out here), overrides, the model's own RoPE base kept, the model put back after a method,
and every bad input refused from the config alone, before any weight loads."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import TEXT, byte_level_tokenizer  # noqa: E402
from posenc.experiments.study import hf_study  # noqa: E402
from posenc.experiments.study.hf_methods import (  # noqa: E402
    METHODS,
    apply_variant,
    default_options,
    method_parameters,
    parse_variants,
)
from posenc.experiments.study.hf_study import run_study  # noqa: E402

CONTEXT, THETA = 64, 5000.0  # a base other than posenc's default 10000: a method that drops it fails


def _config(**extra):
    return transformers.LlamaConfig(
        vocab_size=420, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=CONTEXT, rope_theta=THETA, **extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-llama-5000"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config()).save_pretrained(path)
    byte_level_tokenizer(400).save_pretrained(path)
    return path


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT * 40)
    return str(path)


# ---------------------------------------------------------------------------- defaults


def _smallest(start, holds):
    return next(n for n in itertools.count(start) if holds(n))


@pytest.mark.parametrize("eval_len", [65, 100, 200, 513])
def test_the_defaults_are_the_papers_rules(eval_len):
    c, e, config = CONTEXT, eval_len, _config()
    se = method_parameters("self_extend", config, c, e)["options"]
    assert se["neighbor_window"] == c // 4
    w = se["neighbor_window"]
    # Self-Extend's reach (c - w_n)·G + w_n covers E, and G - 1 would not.
    assert se["group_size"] == _smallest(1, lambda g: (c - w) * g + w >= e)
    assert (c - w) * se["group_size"] + w >= e and (c - w) * (se["group_size"] - 1) + w < e
    assert method_parameters("rerope", config, c, e)["options"] == {"window": c // 2}
    leaky = method_parameters("leaky_rerope", config, c, e)["options"]
    w = c // 2
    assert leaky["window"] == w and leaky["leaky_factor"] == _smallest(1, lambda k: w + (e - w) / k <= c)
    assert w + (e - w) / leaky["leaky_factor"] <= c < w + (e - w) / max(leaky["leaky_factor"] - 1, 1e-9)
    assert method_parameters("dca", config, c, e)["options"] == {"chunk_size": 48, "local_size": 8}


def test_given_options_override_and_the_rest_is_still_derived():
    config = _config()
    both = method_parameters("self_extend:group_size=4,neighbor_window=8", config, CONTEXT, 200)
    assert both["options"] == {"group_size": 4, "neighbor_window": 8}
    window = method_parameters("self_extend:neighbor_window=8", config, CONTEXT, 200)["options"]
    assert window == {"neighbor_window": 8, "group_size": math.ceil((200 - 8) / (CONTEXT - 8))}
    leaky = method_parameters("leaky_rerope:leaky_factor=2.5", config, CONTEXT, 200)["options"]
    assert leaky == {"window": 32, "leaky_factor": 2.5}
    assert method_parameters("dca:local_size=4", config, CONTEXT, 200)["options"] == {
        "chunk_size": 48,
        "local_size": 4,
    }
    # The model's RoPE (its base) is what every method rotates with, unless a scaling replaces it.
    assert both["rope_parameters"] == {"rope_theta": THETA, "rope_type": "default"}
    yarn = method_parameters("rerope:scaling=yarn,factor=3", config, CONTEXT, 200)["rope_parameters"]
    assert yarn == {
        "rope_theta": THETA,
        "rope_type": "yarn",
        "factor": 3.0,
        "original_max_position_embeddings": 64,
    }


def test_a_method_item_keeps_its_comma_separated_options():
    items = parse_variants("none,yarn:4,self_extend:group_size=4,neighbor_window=512,dca,rerope:window=3")
    assert items == [
        "none",
        "yarn:4",
        "self_extend:group_size=4,neighbor_window=512",
        "dca",
        "rerope:window=3",
    ]
    assert set(METHODS) == {"self_extend", "rerope", "leaky_rerope", "string_shift", "dca", "dpe"}


# ---------------------------------------------------------------------------- on the model


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).double().eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_method_is_the_encoding_swapped_in_with_the_models_base_and_undone_after():
    import posenc.hf

    ids = torch.randint(0, 420, (1, 150), generator=torch.Generator().manual_seed(1))
    model = _tiny()
    original = dict(model.config.rope_parameters)
    want = _logits(model, ids)
    # group_size 1 and leaky_factor 1 are plain RoPE: HF's own logits (only with the model's base 5000).
    # The study refuses them by name (they would be the model's row under a method's name), so the
    # entries are written out here.
    for name, options in (
        ("self_extend", {"group_size": 1, "neighbor_window": 4}),
        ("leaky_rerope", {"window": 4, "leaky_factor": 1.0}),
    ):
        entry = {"method": name, "encoding": name, "options": options, "rope_parameters": original}
        apply_variant(model, entry, original)
        torch.testing.assert_close(_logits(model, ids), want, rtol=1e-9, atol=1e-9)
    # The default Self-Extend at E = 150: w_n = 16, G = ceil((150 - 16) / 48) = 3, base 5000.
    apply_variant(model, method_parameters("self_extend", model.config, CONTEXT, 150), original)
    spec = f"self_extend:group_size=3,neighbor_window=16,base={THETA}"
    reference = posenc.hf.swap_encoding(_tiny(), spec)
    got = _logits(model, ids)
    torch.testing.assert_close(got, _logits(reference, ids), rtol=1e-9, atol=1e-9)
    assert (got - want).abs().max() > 1e-4  # grouped positions past the window change the logits
    # Back to a scaling: the model's own rotary embedding with linear:2, as HF builds it.
    apply_variant(model, {"rope_type": "linear", "factor": 2.0}, original)
    scaled = transformers.LlamaForCausalLM(_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    scaled.load_state_dict(_tiny().state_dict())
    torch.testing.assert_close(
        _logits(model, ids), _logits(scaled.double().eval(), ids), rtol=1e-9, atol=1e-9
    )
    apply_variant(model, None, original)
    torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=0)


def test_string_shift_is_swapped_in_with_its_defaults_from_the_context():
    """At c = 64, E = 150: window min(128, 64/8) = 8, shift max(0.33·150, 150 - 64 + 8) = 94."""
    import posenc.hf

    ids = torch.randint(0, 420, (1, 150), generator=torch.Generator().manual_seed(2))
    model = _tiny()
    original = dict(model.config.rope_parameters)
    want = _logits(model, ids)
    entry = method_parameters("string_shift", model.config, CONTEXT, 150)
    assert entry["options"] == {"window": 8, "shift": 94}
    apply_variant(model, entry, original)
    reference = posenc.hf.swap_encoding(_tiny(), f"string_shift:shift=94,window=8,base={THETA}")
    got = _logits(model, ids)
    torch.testing.assert_close(got, _logits(reference, ids), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[:, :94], want[:, :94], rtol=1e-7, atol=1e-7)  # no pair past the shift yet
    assert (got[:, 94:] - want[:, 94:]).abs().max() > 1e-4


def _ramp_factors(head_dim, base, context, eval_len, window, groups=8):
    """DPE's derived factors restated: group g's slowest pair turns r = c·θ/(2π) times in the
    context; YaRN's ramp (β = 32, α = 1) between 1 and Self-Extend's reach."""
    reach = math.ceil((eval_len - window) / (context - window))
    pairs = head_dim // 2
    size = pairs // groups
    out = []
    for g in range(groups):
        slowest = (g + 1) * size - 1
        turns = context / (2 * math.pi * base ** (2 * slowest / head_dim))
        share = 0.0 if turns >= 32 else 1.0 if turns <= 1 else (32 - turns) / 31
        out.append(math.ceil(round(1 + (reach - 1) * share, 9)))
    return out


def test_dpe_s_factors_follow_yarn_s_ramp_over_each_group_s_slowest_pair():
    config = _config()
    config.hidden_size, config.num_attention_heads, config.head_dim = 512, 8, 64
    config.rope_parameters = {"rope_theta": 100000.0, "rope_type": "default"}
    entry = method_parameters("dpe", config, 8192, 16384)
    want = _ramp_factors(64, 100000.0, 8192, 16384, 1024)
    assert entry["options"] == {"window": 1024, "factors": want}
    assert want[0] == 1 and want[-1] == 3 and len(set(want)) == 3  # extrapolated, ramped, interpolated
    given = method_parameters("dpe:factors=2/8/2/8,window=100", config, 8192, 16384)
    assert given["options"] == {"window": 100, "factors": [2, 8, 2, 8]}


@pytest.mark.parametrize(
    "item,message",
    [
        ("dpe:factors=1/1", "moves no position"),
        ("dpe:factors=2/x", "factors must be whole numbers joined by /"),
        ("dpe:factors=2/2/2", "factors has 3 entries"),
        ("dpe:window=150", "window=150 is not below --eval-len 150"),
    ],
)
def test_dpe_s_bad_items_are_refused_by_name(item, message):
    with pytest.raises(ValueError, match=message):
        method_parameters(item, _tiny().config, CONTEXT, 150)


def test_dpe_is_swapped_in_with_its_derived_factors():
    import posenc.hf

    ids = torch.randint(0, 420, (1, 150), generator=torch.Generator().manual_seed(3))
    model = _tiny()
    original = dict(model.config.rope_parameters)
    entry = method_parameters("dpe", model.config, CONTEXT, 150)
    factors = _ramp_factors(16, THETA, CONTEXT, 150, 8)
    assert entry["options"] == {"window": 8, "factors": factors}
    apply_variant(model, entry, original)
    spec = f"dpe:window=8,factors={'|'.join(map(str, factors))},base={THETA}"
    reference = posenc.hf.swap_encoding(_tiny(), spec)
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=1e-9, atol=1e-9)


def test_the_study_runs_a_method_row_beside_the_model(model_dir, corpus, tmp_path):
    variants = ["self_extend:group_size=2,neighbor_window=32", "none", "rerope"]
    records, settings = run_study(
        model_dir,
        tmp_path / "out",
        task="text-lm",
        eval_len=128,
        eval_examples=1,
        corpus=corpus,
        variants=variants,
    )
    assert settings["encodings"] == [
        "tiny-llama-5000 + self_extend:group_size=2,neighbor_window=32",
        "tiny-llama-5000",
        "tiny-llama-5000 + rerope",
    ]
    assert settings["variants"]["tiny-llama-5000 + rerope"]["options"] == {"window": 32}
    by = {(r["encoding"].partition(" + ")[2], r["length"]): r["value"] for r in records}
    for hi in (8, 16, 24, 32):  # every distance below the neighbour window 32: plain RoPE's numbers
        assert by[(variants[0], hi)] == pytest.approx(by[("", hi)], rel=1e-5)
    assert by[(variants[0], 128)] != pytest.approx(by[("", 128)], rel=1e-6)  # grouped past it
    # The rerope row is the model swapped to rerope:window=c/2 with its base, scored directly.
    import posenc.hf
    from posenc.pretrained.loading import load

    model, tokenizer = load(model_dir)
    posenc.hf.swap_encoding(model, f"rerope:window=32,base={THETA}")
    ids = torch.tensor(tokenizer(TEXT * 40, add_special_tokens=False)["input_ids"])[None, :128]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert by[("rerope", 128)] == pytest.approx(math.exp(float(nll[:, 95:127].mean())), rel=1e-5)
    assert by[("rerope", 128)] != pytest.approx(by[("", 128)], rel=1e-6)


# ---------------------------------------------------------------------------- bad input, before any weight


@pytest.fixture
def no_weights_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(hf_study, "load_model", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


BAD = [
    ("self_extend:neighbor_window=128", r"neighbor_window=128 is not below --eval-len 128"),
    ("rerope:window=200", r"window=200 is not below --eval-len 128"),
    ("leaky_rerope:window=128", r"window=128 is not below --eval-len 128"),
    ("dca:chunk_size=128,local_size=8", r"chunk_size=128 is not below --eval-len 128"),
    ("self_extend:group_size=0", r"'group_size' must be >= 1, got group_size=0"),
    ("leaky_rerope:leaky_factor=0.5", r"'leaky_factor' must be >= 1"),
    ("dca:chunk_size=32,local_size=32", r"local_size=32 must be smaller than chunk_size=32"),
    ("self_extend:scaling=dynamic", r"scaling=dynamic cannot compose with self_extend"),
    ("dca:scaling=longrope", r"scaling=longrope cannot compose with dca"),
    ("rerope:factor=2", r"factor needs scaling="),
    ("self_extend:window=4", r"'window=4' is no option of self_extend"),
    ("self_extend:group_size=two", r"group_size must be a whole number, got 'two'"),
    ("self_extend:neighbor_window=64", r"neighbor_window=64 is not below the model's context 64"),
]


@pytest.mark.parametrize("item, message", BAD)
def test_bad_method_options_are_refused_before_any_weight_loads(
    model_dir, tmp_path, no_weights_load, item, message
):
    with pytest.raises(ValueError, match=r"--eval-variants '" + item.split(",")[0].split(":")[0]) as err:
        run_study(model_dir, tmp_path / "out", task="text-lm", eval_len=128, variants=["none", item])
    assert re.search(message, str(err.value)), str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_method_on_a_model_without_rope_or_with_a_length_dependent_one_is_refused(
    tmp_path, no_weights_load
):
    gpt2 = transformers.GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    with pytest.raises(ValueError, match=r"--eval-variants 'rerope': GPT2Config has no RoPE"):
        method_parameters("rerope", gpt2, 64, 128)
    dynamic = _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"the model's own rope_type 'dynamic' .* \(rerope:scaling=yarn\)"):
        method_parameters("rerope", dynamic, CONTEXT, 128)
    # The fix it names works: a fixed scaling replaces the model's own inside the method.
    assert (
        method_parameters("rerope:scaling=yarn", dynamic, CONTEXT, 128)["rope_parameters"]["rope_type"]
        == "yarn"
    )
    # Through the command's planning, from a saved config alone (no weight file is read).
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(folder)
    byte_level_tokenizer(290).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"--eval-variants 'dca': GPT2Config has no RoPE"):
        run_study(folder, tmp_path / "out", task="text-lm", eval_len=128, variants=["dca"])


# ---------------------------------------------------------------------------- the command line


def test_the_command_takes_a_method_item_and_its_help_says_the_defaults(
    model_dir, corpus, tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    out = tmp_path / "out"
    args = [
        "extrapolate",
        "--hf-model",
        str(model_dir),
        "--task",
        "text-lm",
        "--eval-len",
        "128",
        "--corpus",
        corpus,
    ]
    args += [
        "--eval-variants",
        "none,self_extend:group_size=2,neighbor_window=8",
        "--out",
        str(out),
        "--no-progress",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "self_extend:group_size=2,neighbor_window=8" in " ".join(result.output.replace("│", " ").split())
    bad = CliRunner().invoke(
        app,
        [*args[:-5], "--eval-variants", "dca:local_size=60", "--out", str(tmp_path / "b"), "--no-progress"],
    )
    text = " ".join(bad.output.replace("│", " ").split())
    assert bad.exit_code == 2 and "local_size=60 must be smaller than chunk_size=48" in text
    monkeypatch.setenv("COLUMNS", "3000")
    shown = CliRunner().invoke(app, ["extrapolate", "--help"], terminal_width=3000)
    lines = [" ".join(line.replace("│", " ").split()) for line in shown.output.splitlines()]
    line = next(line for line in lines if line.startswith("--eval-variants "))
    for words in (
        "neighbor_window c/4",
        "(c - w_n)G + w_n >= E",
        "rerope (window c/2)",
        "w + (E - w)/k <= c",
    ):
        assert words in line
    assert "chunk_size 3c/4, local_size c/8" in line


@pytest.mark.parametrize("item, message", BAD[:4] + BAD[6:8])
def test_the_lm_task_refuses_the_same_before_any_weight_loads(
    model_dir, tmp_path, no_weights_load, item, message
):
    from posenc.experiments.study import hf_eval

    with pytest.raises(ValueError, match=message):
        hf_eval.evaluate_hf_model(
            model_dir, tmp_path / "out", task="lm", eval_len=128, variants=["none", item]
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("item", "eval_len", "message"),
    [
        (
            "self_extend:group_size=1",
            2 * CONTEXT,
            r"group_size=1 moves no position, so self_extend is plain RoPE; give a group_size above 1",
        ),
        (
            "leaky_rerope:leaky_factor=1",
            2 * CONTEXT,
            r"leaky_factor=1 moves no position, so leaky_rerope is plain RoPE",
        ),
        (
            "self_extend",
            CONTEXT,
            r"group_size=1 moves no position.*\(derived: --eval-len is within the model's context",
        ),
        ("leaky_rerope", CONTEXT, r"leaky_factor=1 moves no position.*derived"),
    ],
)
def test_a_method_setting_that_moves_no_position_is_refused_by_its_option(item, eval_len, message):
    """Issue 62 item 7: these rows were the model's own numbers under a method's name."""
    with pytest.raises(ValueError, match=message):
        method_parameters(item, _config(), CONTEXT, eval_len)
    method_parameters(item.replace("=1", "=2"), _config(), CONTEXT, 2 * CONTEXT)  # one step up is a method


def test_an_unknown_variant_lists_every_scaling_and_every_method():
    with pytest.raises(
        ValueError,
        match=r"'longrope'.*none, linear, ntk, dynamic, yarn.*self_extend, rerope, leaky_rerope, string_shift, dpe, dca",
    ):
        parse_variants("none,longrope")


def test_string_shift_s_defaults_keep_every_relative_position_inside_the_context():
    """The reference's 0.33 of the length and local window 128, or a larger shift when the largest
    relative position ``E - 1 - S + W`` would pass the context."""
    assert default_options("string_shift", 8192, 16384, {}) == {"window": 128, "shift": 8320}
    assert default_options("string_shift", 8192, 8192, {}) == {"window": 128, "shift": 2703}
    options = default_options("string_shift", 64, 128, {})
    assert 128 - 1 - options["shift"] + options["window"] <= 64 - 1
    with pytest.raises(ValueError, match="plain RoPE"):
        default_options("string_shift", 64, 128, {"shift": 8, "window": 8})
