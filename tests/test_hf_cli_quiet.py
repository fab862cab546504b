"""``posenc extrapolate --hf-model``: HF's own "Loading weights" bars stay out of the command's output."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.utils import logging as hf_logging  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from posenc.cli.app import _load_command_modules, app  # noqa: E402

_load_command_modules()
pytestmark = pytest.mark.hf  # the --hf-model path: CI runs these at both ends of the transformers range


@pytest.fixture
def tiny_llama(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
    )
    path = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("enabled", [True, False])
def test_hf_model_prints_no_hf_progress_bar_and_leaves_the_setting_as_it_was(tiny_llama, tmp_path, enabled):
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        args = ["extrapolate", "--hf-model", str(tiny_llama), "--task", "passkey", "--num-symbols", "16"]
        args += ["--eval-len", "10", "--eval-examples", "2", "--out", str(tmp_path / "out"), "--no-progress"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "Loading weights" not in result.output and "it/s]" not in result.output, result.output
        assert "passkey: exact match by length" in result.output
        assert hf_logging.is_progress_bar_enabled() is enabled
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
