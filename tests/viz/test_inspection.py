"""``posenc inspect`` (``posenc.viz.inspection``) on tiny random HF models saved to tmp: every number
it reports against an independent computation, and the page as a reader sees it in headless Chromium.

The independent sources: numpy on the raw tensors read from the saved ``model.safetensors``
(cosines, norms, the q and k projections), HF's own modules (MPNet's ``compute_position_bias``,
T5's ``compute_bias``, Whisper's ``sinusoids``, each layer's input from ``output_hidden_states``
and its input norm), and RoPE's and RMSNorm's formulas written out here.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from _chromium import VIEWPORT, run_probe
from _inspect_models import (
    BUILDERS,
    GEMMA_TYPES,
    GEMMA_WINDOW,
    gemma_rms,
    layer_inputs,
    numpy_cosine,
    pair_means,
    raw_tensors,
)
from posenc.pretrained.loading import reference_text
from posenc.viz.inspection import inspect_model, write_inspection

#: Tokens the RoPE tests read (the tiny models' contexts are 64 and 96).
TOKENS = 48


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``folder(name)``: the tiny model ``name`` saved once per module."""

    @cache
    def make(name: str) -> Path:
        return BUILDERS[name](tmp_path_factory.mktemp(name) / name)

    return make


@pytest.fixture(scope="module")
def inspected(folder):
    @cache
    def run(name: str):
        return inspect_model(folder(name), tokens=TOKENS)

    return run


# ---------------------------------------------------------------------------- absolute tables


def test_a_learned_table_cosines_and_norms_are_numpys(folder, inspected):
    result = inspected("bert")
    raw = raw_tensors(folder("bert"))["embeddings.position_embeddings.weight"]
    (finding,) = result.findings["tables"]
    assert finding.sinusoid is None and finding.shape == (40, 32)
    np.testing.assert_allclose(finding.cosine, numpy_cosine(raw), atol=1e-10)
    np.testing.assert_allclose(finding.norms, np.linalg.norm(raw, axis=1), atol=1e-10)
    cosine = numpy_cosine(raw)
    for d in (1, 4, 16):
        assert finding.by_offset[d] == pytest.approx(
            np.mean([cosine[p, p + d] for p in range(40 - d)]), abs=1e-10
        )
    (row,) = result.rows
    assert (row.stack, row.layer_type, row.layers, row.heads, row.kv_heads, row.head_dim) == (
        "model", None, (0, 1), 4, 4, 8,
    )  # fmt: skip
    assert [e.family for e in row.encodings] == ["learned absolute"]
    assert result.checks and not result.disagreements


def test_whisper_encoder_is_a_fixed_sinusoid_and_its_decoder_learned(folder, inspected):
    from transformers.models.whisper.modeling_whisper import sinusoids

    result = inspected("whisper")
    tables = {f.name: f for f in result.findings["tables"]}
    encoder, decoder = (
        tables["model.encoder.embed_positions.weight"],
        tables["model.decoder.embed_positions.weight"],
    )
    raw = raw_tensors(folder("whisper"))
    np.testing.assert_allclose(
        raw["model.encoder.embed_positions.weight"], sinusoids(30, 32).numpy(), atol=1e-6
    )
    assert encoder.sinusoid == "halves" and encoder.shape == (30, 32)
    assert decoder.sinusoid is None and decoder.shape == (20, 32)
    np.testing.assert_allclose(
        decoder.cosine, numpy_cosine(raw["model.decoder.embed_positions.weight"]), atol=1e-10
    )
    rows = {row.stack: row for row in result.rows}
    assert set(rows) == {"encoder", "decoder"}
    assert [e.family for e in rows["encoder"].encodings] == ["fixed sinusoid"]
    assert [e.family for e in rows["decoder"].encodings] == ["learned absolute"]
    assert rows["encoder"].layers == (0, 1) and rows["decoder"].heads == 4
    assert not result.disagreements, result.disagreements


def test_a_config_that_does_not_match_its_table_is_a_disagreement(folder, tmp_path):
    import shutil

    broken = tmp_path / "bert"
    shutil.copytree(folder("bert"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["max_position_embeddings"] = 50
    (broken / "config.json").write_text(json.dumps(config))
    (wrong,) = inspect_model(broken).disagreements
    assert "position_embeddings.weight shape" in wrong.what
    assert wrong.config == "50 positions x hidden 32" and wrong.weights == "40 x 32"


# ---------------------------------------------------------------------------- bucketed bias


def test_mpnets_bias_per_distance_is_hfs_position_bias(folder, inspected):
    from transformers import MPNetModel

    result = inspected("mpnet")
    (finding,) = result.findings["buckets"]
    assert (finding.num_buckets, finding.max_distance, finding.bidirectional) == (32, 128, True)
    model = MPNetModel.from_pretrained(folder("mpnet")).eval()
    length = 300
    with torch.no_grad():
        hf = model.encoder.compute_position_bias(torch.zeros(1, length, 32))[0].double().numpy()  # [H, q, k]
    index = {int(r): i for i, r in enumerate(finding.distances)}
    for query, key in ((0, 0), (5, 6), (6, 5), (0, 90), (90, 0), (10, 266), (256, 0)):
        np.testing.assert_allclose(finding.bias[:, index[key - query]], hf[:, query, key], atol=1e-6)
    # The edges: where HF's bucket of r differs from that of the distance next to it towards 0.
    bucket = model.encoder.relative_position_bucket
    b = {r: int(bucket(torch.tensor(r))) for r in range(-256, 257)}
    walked = sorted(
        [r for r in range(1, 257) if b[r] != b[r - 1]] + [r for r in range(-256, 0) if b[r] != b[r + 1]]
    )
    assert [int(e) for e in finding.edges] == walked
    (row,) = result.rows
    assert [e.family for e in row.encodings] == ["learned absolute", "bucketed relative bias"]
    assert not result.disagreements


def test_t5_has_a_bidirectional_encoder_bias_and_a_causal_decoder_bias(folder, inspected):
    from transformers import T5Model

    result = inspected("t5")
    found = {f.name.split(".")[0]: f for f in result.findings["buckets"]}
    assert found["encoder"].bidirectional and not found["decoder"].bidirectional
    model = T5Model.from_pretrained(folder("t5")).eval()
    for stack in ("encoder", "decoder"):
        attention = getattr(model, stack).block[0].layer[0].SelfAttention
        with torch.no_grad():
            hf = attention.compute_bias(50, 50)[0].double().numpy()  # [H, q, k]
        finding = found[stack]
        index = {int(r): i for i, r in enumerate(finding.distances)}
        pairs = [(0, 0), (9, 3), (40, 1), (45, 5)] + ([(3, 9), (1, 40)] if stack == "encoder" else [])
        for query, key in pairs:
            np.testing.assert_allclose(finding.bias[:, index[key - query]], hf[:, query, key], atol=1e-6)
    rows = {row.stack: row for row in result.rows}
    assert rows["decoder"].encodings[0].options["direction"] == "causal"
    assert not result.disagreements


# ---------------------------------------------------------------------------- RoPE


def test_llama_pair_norms_are_the_projections_pairs_with_gqa(folder, inspected):
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = folder("llama")
    (finding,) = inspected("llama").findings["rotary"]
    ids = AutoTokenizer.from_pretrained(path)(reference_text()[:2000])["input_ids"][:TOKENS]
    _, inputs = layer_inputs(LlamaForCausalLM, path, torch.tensor([ids]))
    raw = raw_tensors(path)
    for layer, x in enumerate(inputs):
        q = x @ raw[f"model.layers.{layer}.self_attn.q_proj.weight"].T
        k = x @ raw[f"model.layers.{layer}.self_attn.k_proj.weight"].T
        np.testing.assert_allclose(
            finding.q_norms[layer], pair_means(q.reshape(TOKENS, 4, 8)), rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(
            finding.k_norms[layer], pair_means(k.reshape(TOKENS, 2, 8)), rtol=1e-4, atol=1e-6
        )
    expected = 1.0 / 500.0 ** (np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(finding.inv_freq[None], expected, rtol=1e-6)
    # 2π·500^(2k/8) for k = 0..3: 6.3, 29.7, 140.5, 664.4; the context is 96.
    assert finding.beyond(None).tolist() == [2, 3]
    assert finding.tokens == TOKENS


def test_gemma3_layer_types_windows_thetas_and_normedpair_means(folder, inspected):
    from transformers import Gemma3ForCausalLM

    path = folder("gemma3")
    result = inspected("gemma3")
    rows = {row.layer_type: row for row in result.rows}
    assert rows["sliding_attention"].layers == (0, 1, 3) and rows["full_attention"].layers == (2, 4)
    assert rows["sliding_attention"].window == GEMMA_WINDOW and rows["full_attention"].window is None
    assert rows["sliding_attention"].encodings[0].options["rope_theta"] == 10000.0
    assert rows["full_attention"].encodings[0].options["rope_theta"] == 1000000.0
    assert (
        rows["full_attention"].heads,
        rows["full_attention"].kv_heads,
        rows["full_attention"].head_dim,
    ) == (4, 2, 16)
    assert not result.disagreements, result.disagreements
    (finding,) = result.findings["rotary"]
    assert finding.layer_types == tuple(GEMMA_TYPES)
    for kind, theta in (("sliding_attention", 1e4), ("full_attention", 1e6)):
        np.testing.assert_allclose(
            finding.inv_freq[kind], 1.0 / theta ** (np.arange(0, 16, 2) / 16), rtol=1e-6
        )
    # No tokenizer in the folder: the reference text's UTF-8 bytes modulo the vocabulary (64).
    ids = [byte % 64 for byte in reference_text().encode("utf-8")[:TOKENS]]
    model, inputs = layer_inputs(Gemma3ForCausalLM, path, torch.tensor([ids]))
    raw, eps = raw_tensors(path), model.config.rms_norm_eps
    for layer, x in enumerate(inputs):
        prefix = f"model.layers.{layer}.self_attn"
        q = (x @ raw[f"{prefix}.q_proj.weight"].T).reshape(TOKENS, 4, 16)
        k = (x @ raw[f"{prefix}.k_proj.weight"].T).reshape(TOKENS, 2, 16)
        q, k = (
            gemma_rms(q, raw[f"{prefix}.q_norm.weight"], eps),
            gemma_rms(k, raw[f"{prefix}.k_norm.weight"], eps),
        )
        np.testing.assert_allclose(finding.q_norms[layer], pair_means(q), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(finding.k_norms[layer], pair_means(k), rtol=1e-4, atol=1e-6)
    # Context 64: 2π·θ^(2k/16) > 64 from k = 3 (theta 1e4: 2π·10^1.5 = 198.7) and k = 2 (theta 1e6: 198.7).
    assert finding.beyond("sliding_attention").tolist() == [3, 4, 5, 6, 7]
    assert finding.beyond("full_attention").tolist() == [2, 3, 4, 5, 6, 7]


# ---------------------------------------------------------------------------- the page

#: Measures the page once loaded: every image decoded, numeric cells on one line, nothing wider than the window.
PROBE = """<script>
window.addEventListener("load", () => {
  const cells = [];
  for (const cell of document.querySelectorAll("td, th")) {
    const text = cell.textContent.trim();
    if (!/[0-9]/.test(text) || cell.querySelector("br")) continue;
    const range = document.createRange(); range.selectNodeContents(cell);
    const rects = Array.from(range.getClientRects()).filter((r) => r.width > 0).sort((a, b) => a.top - b.top);
    let lines = 0, bottom = -Infinity;
    for (const r of rects) { if (r.top >= bottom - 1) { lines += 1; bottom = r.bottom; } else { bottom = Math.max(bottom, r.bottom); } }
    cells.push({text: text, lines: lines, table: (cell.closest("table") || {}).id || ""});
  }
  const wide = Array.from(document.querySelectorAll("table, figure, img")).map((el) => el.getBoundingClientRect().right)
    .filter((right) => right > window.innerWidth);
  const images = Array.from(document.images).map((i) => ({alt: i.alt, width: i.naturalWidth, complete: i.complete}));
  const out = document.createElement("pre"); out.id = "probe";
  out.textContent = JSON.stringify({width: window.innerWidth, scroll: document.documentElement.scrollWidth,
                                    wide, cells, images});
  document.body.appendChild(out);
});
</script>"""


def _cells(page: str, table_id: str) -> list[list[str]]:
    """The body rows of table ``table_id`` of ``page``, as text."""
    body = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', page, re.S).group(1)
    return [re.findall(r"<td>(.*?)</td>", row, re.S) for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


@pytest.mark.parametrize("name", ["mpnet", "gemma3"])
def test_the_page_renders_and_reports_the_numbers(name, inspected, tmp_path):
    result = inspected(name)
    page = write_inspection(result, tmp_path / "out")
    assert page == tmp_path / "out" / "index.html"
    text = page.read_text()
    for url in re.findall(r'(?:src|href)\s*=\s*["\']([^"\']*)', text):
        assert url.startswith("data:"), url  # self-contained
    figures = sorted(p.name for p in (tmp_path / "out" / "figures").iterdir())
    numbers = json.loads((tmp_path / "out" / "inspect.json").read_text())
    assert numbers["model_type"] == result.view.config.model_type
    measured = run_probe(page, tmp_path, PROBE)
    assert len(measured["images"]) == len(figures) >= 2
    assert all(image["complete"] and image["width"] > 300 for image in measured["images"]), measured["images"]
    assert not [c for c in measured["cells"] if c["lines"] > 1], [
        c for c in measured["cells"] if c["lines"] > 1
    ][:5]
    assert measured["scroll"] <= VIEWPORT[0] and not measured["wide"], measured
    assert {c["table"] for c in measured["cells"]} >= {"layers", "checks"}
    if name == "mpnet":
        _check_bias_table(text, result)
    else:
        _check_rotary_table(text, result)


def _check_bias_table(text: str, result) -> None:
    """The page's bias table: HF's bias per head at the distances of its header, to 2 decimals."""
    (finding,) = result.findings["buckets"]
    head = re.search(r'<table id="buckets-0"><thead><tr>(.*?)</tr>', text, re.S).group(1)
    distances = [int(d.replace("+", "")) for d in re.findall(r"<th>([+-]?\d+)</th>", head)]
    assert 0 in distances and -128 in distances and 128 in distances
    index = {int(r): i for i, r in enumerate(finding.distances)}
    for h, row in enumerate(_cells(text, "buckets-0")):
        assert row[0] == f"head {h}"
        assert [float(v) for v in row[1:]] == [round(float(finding.bias[h, index[d]]), 2) for d in distances]


def _check_rotary_table(text: str, result) -> None:
    """The page's RoPE table: per layer type its layers and the pairs past the context (the test's own
    wavelengths, 2π·θ^(2k/d) against 64)."""
    rows = {row[0]: row for row in _cells(text, "rotary-0")}
    assert rows["sliding_attention"][1] == "0-1, 3" and rows["full_attention"][1] == "2, 4"
    for kind, theta in (("sliding_attention", 1e4), ("full_attention", 1e6)):
        lengths = 2 * math.pi * theta ** (np.arange(0, 16, 2) / 16)
        past = np.nonzero(lengths > 64)[0]
        assert rows[kind][4] == f"{len(past)} ({past.min()}-{past.max()})"
