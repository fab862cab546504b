"""A fuzzer over every registered encoding's declared options (issue 62 item 8): spec strings with one
option set to a value drawn from in-range numbers, edges, out-of-range numbers, wrong types, nan,
inf and huge values, built into a layer and run once. Each either works or fails with a
``ValueError``/``TypeError`` that names the option (or the encoding): never another exception, and
never a table or module so large it takes minutes.

The values it found, kept below as regression cases: xPos's ``gamma`` and ``scale_base`` at 1e30 and
1e308 (a division by zero, an overflow, a nan cast to int), FoX's ``bias_init`` at 1e308 (a float32
overflow), DINOv3's ``shift`` at 1e308 (a random draw out of range), ``mlp_bias``'s ``hidden_dim``
at 100,000 (an allocation of 40 GB) and ``depth`` at 100,000 (minutes of modules).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import posenc
from posenc.encodings.registry import get_class, options

NAMES = posenc.available()
TEXT_VALUES = ["nan", "inf", "-inf", "1e308", "-1e308", "1e30", "0", "-1", "1", "2", "0.5", "-0.5",
               "abc", "true", "none", "[1,2]", "1.5", "100000", "-100000", "7", "16", "33"]  # fmt: skip
VALUES = st.one_of(st.sampled_from(TEXT_VALUES), st.integers(-5, 40).map(str))


def _spec(name: str, option: str, value: str) -> str:
    given = {**get_class(name).example_options, option: value}
    return name + ":" + ",".join(f"{k}={v}" for k, v in given.items())


def _works_or_names_the_option(name: str, option: str, value: str) -> None:
    spec = _spec(name, option, value)
    try:
        layer = posenc.MultiheadAttention(32, 2, spec, causal=True)
        with torch.no_grad():
            layer(torch.randn(1, 5, 32))
    except (ValueError, TypeError) as error:
        assert option in str(error) or name in str(error), f"{spec}: {error}"
    except Exception as error:  # the point: no other exception may escape
        raise AssertionError(f"{spec}: {type(error).__name__}: {error}") from error


@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(NAMES), data=st.data())
def test_every_option_value_works_or_is_refused_by_name(name, data):
    declared = [option for option in options(name) if option != "head_dim"]
    if declared:
        _works_or_names_the_option(name, data.draw(st.sampled_from(declared)), data.draw(VALUES))


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [
        ("xpos", "gamma", "1e30"),
        ("xpos", "gamma", "1e308"),
        ("xpos", "scale_base", "1e308"),
        ("fox", "bias_init", "1e308"),
        ("dinov3_rope", "shift", "1e308"),
        ("mlp_bias", "hidden_dim", "100000"),
        ("mlp_bias", "depth", "100000"),
    ],
)
def test_what_the_fuzzer_found_is_refused_by_name(name, option, value):
    with pytest.raises(ValueError, match=option):
        posenc.MultiheadAttention(32, 2, _spec(name, option, value), causal=True)


# ---------------------------------------------------------------------------- the CLI's options
class _Checked(Exception):
    """Raised where ``posenc extrapolate`` would start training: every check has passed."""


def _extrapolate_options() -> list[str]:
    """``posenc extrapolate``'s options that take a value, but the folder, the model study and presets."""
    import typer.main

    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    command = typer.main.get_command(app).commands["extrapolate"]
    skip = {
        "--out",
        "--hf-model",
        "--preset",
        "--shard",
        "--device",
        "--workers",
        "--threads",
    }  # (threads: process-wide)
    return [
        param.opts[0]
        for param in command.params
        if param.opts and param.opts[0].startswith("--") and not param.is_flag and param.opts[0] not in skip
    ]


EXTRAPOLATE = _extrapolate_options()


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(option=st.sampled_from(EXTRAPOLATE), value=VALUES)
def test_every_extrapolate_option_works_or_exits_2_naming_it(
    option, value, tmp_path_factory, monkeypatch_module
):
    """Run to the point where training would start (``plan_runs`` replaced): the command's checks
    either pass or end in exit 2 with a message that names the option, never a traceback."""
    from typer.testing import CliRunner

    from posenc.cli.app import app

    out = tmp_path_factory.mktemp("fuzz")
    result = CliRunner().invoke(app, ["extrapolate", "--out", str(out), "--no-progress", option, value])
    if isinstance(result.exception, _Checked):
        return
    words = " ".join(result.output.split())
    name = option.lstrip("-")
    assert result.exit_code == 2, f"{option} {value}: exit {result.exit_code}, {result.exception!r}\n{words}"
    assert option in words or name in words or name.replace("-", "_") in words, f"{option} {value}: {words}"


@pytest.fixture(scope="module")
def monkeypatch_module():
    import posenc.experiments.runner as runner

    patch = pytest.MonkeyPatch()

    def checked(*args, **kwargs):
        raise _Checked

    patch.setattr(runner, "plan_runs", checked)
    yield patch
    patch.undo()


def _study_options() -> list[str]:
    import typer.main

    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    command = typer.main.get_command(app).commands["study"]
    skip = {"--out", "--shard", "--device", "--corpus", "--threads"}  # (threads: process-wide)
    return [
        param.opts[0]
        for param in command.params
        if param.opts and param.opts[0].startswith("--") and not param.is_flag and param.opts[0] not in skip
    ]


STUDY = _study_options()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from _tiny_hf import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", 64)


@pytest.fixture(scope="module")
def study_stopped_at_the_weights():
    import posenc.experiments.study.hf_study as hf_study

    patch = pytest.MonkeyPatch()

    def checked(*args, **kwargs):
        raise _Checked

    patch.setattr(hf_study, "load_model", checked)
    yield patch
    patch.undo()


@pytest.mark.hf
@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(option=st.sampled_from(STUDY), value=VALUES)
def test_every_study_option_works_or_exits_2_naming_it(
    option, value, tiny_model, tmp_path_factory, study_stopped_at_the_weights
):
    """``posenc study`` on a tiny model, run to where the weights would load: the checks pass, or the
    command exits 2 with a message naming the option in its own words."""
    from typer.testing import CliRunner

    from posenc.cli.app import app

    out = tmp_path_factory.mktemp("fuzz-study")
    args = ["study", str(tiny_model), "--out", str(out), "--no-progress", option, value]
    result = CliRunner().invoke(app, args)
    if isinstance(result.exception, _Checked):
        return
    words = " ".join(result.output.split())
    name = option.lstrip("-")
    assert result.exit_code == 2, f"{option} {value}: exit {result.exit_code}, {result.exception!r}\n{words}"
    assert option in words or name in words or name.replace("-", "_") in words, f"{option} {value}: {words}"


@pytest.mark.parametrize("value", TEXT_VALUES)
def test_inspect_and_models_fetch_refuse_what_they_cannot_read_by_name(value, tmp_path):
    """``posenc inspect VALUE`` and ``posenc models fetch VALUE`` with a value that is no model: exit 2
    and an ``error:`` line naming it (nothing downloaded), never a traceback."""
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    # (after "--": a value that starts with "-" is the argument, not an option)
    for args in (["inspect", "--out", str(tmp_path / "page"), "--", value], ["models", "fetch", "--", value]):
        result = CliRunner().invoke(app, args)
        words = " ".join(result.output.split())
        assert result.exit_code == 2, f"{args}: exit {result.exit_code}, {result.exception!r}\n{words}"
        assert "error" in words.lower() and value in words, f"{args}: {words}"
