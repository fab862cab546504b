"""``posenc inspect`` on the five fetched checkpoints (marker ``real``): what each page reports, against
the raw weights (numpy), HF's own modules and the formulas written out here.

The models come from ``posenc models fetch`` (into ``$POSENC_MODELS``); absent, these tests skip with
that command, and fail instead under ``POSENC_REQUIRE_REAL=1`` (CI).
"""

from __future__ import annotations

import math
import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.real

pytest.importorskip("transformers")

from _inspect_models import gemma_rms, layer_inputs, numpy_cosine, pair_means, raw_tensors  # noqa: E402
from posenc.pretrained.loading import reference_text  # noqa: E402
from posenc.viz.inspection import inspect_model, write_inspection  # noqa: E402

#: CI sets it: a missing model fails the tests instead of skipping them.
REQUIRE_REAL = os.environ.get("POSENC_REQUIRE_REAL") == "1"

#: Tokens of the reference text the RoPE models read here.
TOKENS = 256


def _missing(why: str) -> None:
    if REQUIRE_REAL:
        pytest.fail(f"POSENC_REQUIRE_REAL=1 but {why}")
    pytest.skip(why)


@cache
def _folder(name: str) -> Path:
    """The HF folder of the fetched model ``name`` (converted once), or a skip naming the fetch command."""
    from posenc.pretrained.loading import MODELS, convert, fetch_command, model_path

    if name not in MODELS:
        _missing(f"{name} is not in this posenc's catalog")
    try:
        model_path(name)
    except FileNotFoundError:
        _missing(f"{name} is not fetched: run `{fetch_command([name])}`")
    if MODELS[name].form == "gguf":
        pytest.importorskip("gguf")
    try:
        return convert(name)
    except ImportError as err:  # a converter this install lacks
        _missing(f"{name} cannot be converted here: {err}")
        raise


@cache
def _inspected(name: str):
    _folder(name)
    return inspect_model(name, tokens=TOKENS)


def _page(name: str, tmp_path: Path) -> str:
    page = write_inspection(_inspected(name), tmp_path / name)
    return page.read_text()


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "minilm-l6", "mpnet-base", "whisper-base"])
def test_config_and_weights_agree_and_the_page_is_written(name, tmp_path):
    result = _inspected(name)
    assert result.checks and not result.disagreements, result.disagreements
    text = _page(name, tmp_path)
    assert text.count("<img ") == len(list((tmp_path / name / "figures").iterdir())) >= 1


def test_smollm2_rope_pairs_past_the_context_and_its_query_norms():
    from transformers import AutoTokenizer, LlamaForCausalLM

    result = _inspected("smollm2-135m")
    (row,) = result.rows
    assert (row.layers, row.heads, row.kv_heads, row.head_dim) == (tuple(range(30)), 9, 3, 64)
    (finding,) = result.findings["rotary"]
    assert finding.context == 8192 and finding.tokens == TOKENS
    lengths = 2 * math.pi * 1e5 ** (np.arange(0, 64, 2) / 64)
    assert finding.beyond(None).tolist() == np.nonzero(lengths > 8192)[0].tolist() == list(range(20, 32))
    path = _folder("smollm2-135m")
    ids = AutoTokenizer.from_pretrained(path)(reference_text()[: 16 * TOKENS])
    ids = torch.tensor([ids["input_ids"][:TOKENS]])
    _, inputs = layer_inputs(LlamaForCausalLM, path, ids)
    raw = raw_tensors(path)
    for layer in (0, 29):
        q = inputs[layer] @ raw[f"model.layers.{layer}.self_attn.q_proj.weight"].T
        k = inputs[layer] @ raw[f"model.layers.{layer}.self_attn.k_proj.weight"].T
        np.testing.assert_allclose(
            finding.q_norms[layer], pair_means(q.reshape(TOKENS, 9, 64)), rtol=1e-3, atol=1e-5
        )
        np.testing.assert_allclose(
            finding.k_norms[layer], pair_means(k.reshape(TOKENS, 3, 64)), rtol=1e-3, atol=1e-5
        )


def test_gemma3_local_and_global_layers_and_a_global_layers_normed_pairs():
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    result = _inspected("gemma3-270m")
    rows = {row.layer_type: row for row in result.rows}
    assert rows["full_attention"].layers == (5, 11, 17) and len(rows["sliding_attention"].layers) == 15
    assert rows["sliding_attention"].window == 512 and rows["full_attention"].window is None
    assert rows["sliding_attention"].encodings[0].options["rope_theta"] == 1e4
    assert rows["full_attention"].encodings[0].options["rope_theta"] == 1e6
    (finding,) = result.findings["rotary"]
    for kind, theta in (("sliding_attention", 1e4), ("full_attention", 1e6)):
        lengths = 2 * math.pi * theta ** (np.arange(0, 256, 2) / 256)
        assert finding.beyond(kind).tolist() == np.nonzero(lengths > 32768)[0].tolist()
    path = _folder("gemma3-270m")
    text = reference_text()[: 16 * TOKENS]
    ids = torch.tensor([AutoTokenizer.from_pretrained(path)(text)["input_ids"][:TOKENS]])
    model, inputs = layer_inputs(Gemma3ForCausalLM, path, ids)
    raw, eps, layer = raw_tensors(path), model.config.rms_norm_eps, 5
    prefix = f"model.layers.{layer}.self_attn"
    q = (inputs[layer] @ raw[f"{prefix}.q_proj.weight"].T).reshape(TOKENS, 4, 256)
    np.testing.assert_allclose(
        finding.q_norms[layer],
        pair_means(gemma_rms(q, raw[f"{prefix}.q_norm.weight"], eps)),
        rtol=1e-3,
        atol=1e-5,
    )


def test_minilm_learned_table_and_its_band():
    result = _inspected("minilm-l6")
    (finding,) = result.findings["tables"]
    assert finding.sinusoid is None and finding.shape == (512, 384)
    raw = raw_tensors(_folder("minilm-l6"))
    (name,) = [n for n in raw if n.endswith("position_embeddings.weight")]
    np.testing.assert_allclose(finding.cosine, numpy_cosine(raw[name]), atol=1e-9)
    assert finding.by_offset[1] > finding.by_offset[16] > finding.by_offset[256]  # the band


def test_mpnet_table_padding_row_and_bias_per_head():
    from transformers import MPNetModel

    result = _inspected("mpnet-base")
    (table,) = result.findings["tables"]
    assert table.shape == (514, 768) and table.zero_rows == (1,)  # padding_idx 1; positions start at 2
    (bias,) = result.findings["buckets"]
    assert (bias.num_buckets, bias.max_distance, bias.bidirectional) == (32, 128, True)
    model = MPNetModel.from_pretrained(_folder("mpnet-base")).eval()
    with torch.no_grad():
        hf = model.encoder.compute_position_bias(torch.zeros(1, 300, 768))[0].double().numpy()
    index = {int(r): i for i, r in enumerate(bias.distances)}
    for query, key in ((0, 0), (10, 11), (11, 10), (0, 91), (200, 2), (5, 260)):
        np.testing.assert_allclose(bias.bias[:, index[key - query]], hf[:, query, key], atol=1e-5)


def test_whisper_encoder_sinusoid_and_decoder_table():
    from transformers.models.whisper.modeling_whisper import sinusoids

    result = _inspected("whisper-base")
    tables = {f.name.split(".")[1]: f for f in result.findings["tables"]}
    assert tables["encoder"].sinusoid == "halves" and tables["encoder"].shape == (1500, 512)
    assert tables["decoder"].sinusoid is None and tables["decoder"].shape == (448, 512)
    raw = raw_tensors(_folder("whisper-base"))
    np.testing.assert_allclose(
        raw["model.encoder.embed_positions.weight"], sinusoids(1500, 512).numpy(), atol=5e-3
    )
    rows = {row.stack: row for row in result.rows}
    assert (rows["encoder"].layers, rows["decoder"].heads, rows["decoder"].head_dim) == (
        tuple(range(6)),
        8,
        64,
    )


def test_a_gguf_file_reads_as_its_converted_folder():
    from posenc.pretrained.loading import model_path

    _folder("smollm2-135m")
    pytest.importorskip("gguf")
    from_gguf = inspect_model(model_path("smollm2-135m"), tokens=64)
    from_folder = inspect_model("smollm2-135m", tokens=64)
    assert from_gguf.view.source == "gguf" and not from_gguf.disagreements
    assert [(r.layers, r.heads, r.kv_heads, r.head_dim) for r in from_gguf.rows] == [
        (r.layers, r.heads, r.kv_heads, r.head_dim) for r in from_folder.rows
    ]
    (gguf,), (folder,) = from_gguf.findings["rotary"], from_folder.findings["rotary"]
    np.testing.assert_allclose(gguf.q_norms, folder.q_norms, rtol=1e-4, atol=1e-6)
