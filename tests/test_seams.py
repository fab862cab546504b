"""Canaries on the seams where posenc binds to code it does not own (``posenc.seams``).

One canary per seam compares the signature posenc binds to with the installed one, so a release
that moves a seam fails one test by name, with one line saying what changed. Each canary is shown to
fail by monkeypatching a changed signature into the installed project here. The bridges bind by what
the installed interface offers, and refuse anything else naming what they expected, what they found
and the supported range (never "upgrade": the installed release may be the newer one).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import types
import warnings

import pytest
import torch

from posenc.seams import SEAMS, TORCH_RANGE, TRANSFORMERS_RANGE

pytestmark = pytest.mark.hf  # the posenc.hf seam: CI runs these at both ends of the transformers range

_HF_SEAMS = [key for key, seam in SEAMS.items() if seam.package == "transformers"]
_TORCH_SEAMS = [key for key, seam in SEAMS.items() if seam.package == "torch"]


@pytest.mark.parametrize("key", list(SEAMS))
def test_canary(key):
    seam = SEAMS[key]
    if seam.package == "transformers":
        pytest.importorskip("transformers")
    line = seam.drift()
    assert line is None, line


def _changed_python_signature(monkeypatch, seam):
    """Replace the seam's callable by one whose parameters differ: the last named one renamed."""
    owner = importlib.import_module(seam.module)
    *parents, name = seam.path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    original = seam.parameters()
    renamed = [p for p in original if not p.startswith("*")]
    renamed[-1] = renamed[-1] + "_v2"
    source = f"def fake({', '.join(renamed)}, **kwargs): pass"
    namespace: dict = {}
    exec(source, namespace)
    monkeypatch.setattr(owner, name, namespace["fake"])
    return original[-2] if original[-1].startswith("**") else original[-1]


@pytest.mark.parametrize("key", _HF_SEAMS)
def test_canary_fails_on_a_changed_hf_signature(monkeypatch, key):
    pytest.importorskip("transformers")
    seam = SEAMS[key]
    renamed = _changed_python_signature(monkeypatch, seam)
    line = seam.drift()
    assert line is not None and "\n" not in line
    assert line.startswith(f"{seam.name} changed in transformers ")
    assert f"added {renamed}_v2" in line
    assert f"transformers{TRANSFORMERS_RANGE}" in line


_CHANGED_SCHEMAS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": (
        "aten::fake(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, *, "
        "Tensor? attn_mask=None, float? scale=None, bool enable_gqa=False) -> (Tensor output, Tensor logsumexp)",
        "added bool enable_gqa",
    ),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (
        "aten::fake(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
        "float dropout_p, bool is_causal, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor grad_query, "
        "Tensor grad_key)",
        "removed -> Tensor grad_value",
    ),
}


def _fake_op(schema: str) -> object:
    return types.SimpleNamespace(default=types.SimpleNamespace(_schema=torch._C.parse_schema(schema)))


@pytest.mark.parametrize("key", _TORCH_SEAMS)
def test_canary_fails_on_a_changed_torch_schema(monkeypatch, key):
    seam = SEAMS[key]
    schema, change = _CHANGED_SCHEMAS[key]
    monkeypatch.setattr(torch.ops.aten, seam.path.rsplit(".", 1)[1], _fake_op(schema))
    line = seam.drift()
    assert line is not None and line.startswith(f"{seam.name} changed in torch ") and change in line


def test_a_changed_flash_schema_turns_the_flash_paths_off_with_a_warning(monkeypatch):
    from posenc.backends import AttentionRequest, backend_reasons
    from posenc.backends.parts import flash as _flash

    key = "aten::_scaled_dot_product_flash_attention_for_cpu"
    monkeypatch.setattr(torch.ops.aten, SEAMS[key].path.rsplit(".", 1)[1], _fake_op(_CHANGED_SCHEMAS[key][0]))
    _flash._schema_drift.cache_clear()
    try:
        with pytest.warns(
            RuntimeWarning, match="does not call the CPU flash kernel: .*added bool enable_gqa"
        ):
            assert not _flash.cpu_flash_available()
        q = torch.randn(1, 2, 5, 8)
        request = AttentionRequest.from_keywords(
            q=q, k=q, v=q, encoding=_nope(), q_pos=torch.arange(5)[None], k_pos=torch.arange(5)[None],
            scale=0.3, causal=True, sinks=torch.zeros(2),
        )  # fmt: skip
        assert any("flash kernel" in reason for reason in backend_reasons(request)["sdpa"])
    finally:
        monkeypatch.undo()
        _flash._schema_drift.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _flash.cpu_flash_available()


def _nope():
    import posenc

    return posenc.build("nope")


# ---------------------------------------------------------------------------- the bridges bind by interface


def _tiny_t5(model_class_name="T5EncoderModel"):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=20, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
        dropout_rate=0.0,
    )  # fmt: skip
    return getattr(transformers, model_class_name)(config).eval()


def test_an_unknown_t5_interface_is_refused_with_expected_found_and_range(monkeypatch):
    from transformers.models.t5 import modeling_t5

    import posenc.hf as posenc_hf

    model = _tiny_t5()

    def forward(
        self, hidden_states, mask=None, key_value_states=None, position_bias=None, kv_cache=None, **kw
    ):
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_t5.T5Attention, "forward", forward)
    with pytest.raises(ValueError) as info:
        posenc_hf.use_posenc_attention(model)
    message = str(info.value)
    assert "T5Attention.forward" in message
    assert (
        "expected forward(hidden_states, mask, key_value_states, position_bias, cache or past_key_values"
        in message
    )
    assert "found forward(hidden_states, mask, key_value_states, position_bias, kv_cache, **kw)" in message
    assert f"transformers{TRANSFORMERS_RANGE}" in message
    assert "upgrade" not in message.lower()


def test_an_unknown_bloom_interface_is_refused(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.bloom import modeling_bloom

    import posenc.hf as posenc_hf

    model = transformers.BloomModel(
        transformers.BloomConfig(vocab_size=20, hidden_size=16, n_layer=1, n_head=2)
    )

    def forward(self, hidden_states, residual, alibi, attention_mask, cache=None, use_cache=False, **kw):
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_bloom.BloomAttention, "forward", forward)
    with pytest.raises(
        ValueError, match=r"BloomAttention.forward .* lacking layer_past, output_attentions\. posenc"
    ):
        posenc_hf.use_posenc_attention(model)


def test_the_t5_bridge_takes_the_cache_under_either_name():
    """transformers 5.15-5.23 pass ``past_key_values``, 5.24 ``cache``: the same result either way."""
    transformers = pytest.importorskip("transformers")
    import posenc.hf as posenc_hf

    model = posenc_hf.use_posenc_attention(_tiny_t5("T5ForConditionalGeneration"))
    attention = model.decoder.block[0].layer[0].SelfAttention
    x = torch.randn(2, 3, 16)
    outs = []
    for name in ("cache", "past_key_values"):
        cache = transformers.DynamicCache(config=model.config.get_text_config(decoder=True))
        first = attention(x[:, :2], **{name: cache})[0]
        second = attention(x[:, 2:], **{name: cache})[0]
        assert cache.get_seq_length(0) == 3
        outs.append(torch.cat([first, second], 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    uncached = attention(x)[0]
    torch.testing.assert_close(outs[0], uncached, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("paged", ["cache", "read_index"])
def test_the_paged_cache_is_refused_under_both_conventions(paged):
    pytest.importorskip("transformers")
    import posenc.hf as posenc_hf

    class PagedAttentionCache:  # what 5.19-5.23 hand over as `cache`
        pass

    value = PagedAttentionCache() if paged == "cache" else [torch.zeros(3, dtype=torch.long)]
    q = torch.randn(1, 2, 3, 4)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="paged cache"):
        posenc_hf.attention_forward(module, q, q, q, None, **{paged: value})


# ---------------------------------------------------------------------------- declared ranges


def _declared(package: str, extra: str) -> set[str]:
    """The specifier clauses posenc's installed metadata declares for ``package`` in ``extra``."""
    for requirement in importlib.metadata.requires("posenc") or []:
        name, _, marker = requirement.partition(";")
        if f'extra == "{extra}"' not in marker:
            continue
        spec = name.strip()
        if spec.startswith(package) and spec[len(package)] in "<>=!~ ":
            return {clause.strip() for clause in spec[len(package) :].split(",")}
    raise AssertionError(f"posenc declares no {package} requirement in its {extra!r} extra")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.lstrip("<>=!~").split("."))


def test_pyproject_declares_the_torch_range_ci_tests():
    """The core requirement is TORCH_RANGE (the range .ci/run tests at both ends), floor and cap."""
    (requirement,) = [
        r for r in importlib.metadata.requires("posenc") or [] if r.startswith("torch") and ";" not in r
    ]
    declared = {clause.strip() for clause in requirement[len("torch") :].split(",")}
    assert declared == {clause.strip() for clause in TORCH_RANGE.split(",")}


def test_the_installed_torch_is_in_the_declared_range():
    import torch

    cap, floor = sorted(TORCH_RANGE.split(","))  # "<2.16", ">=2.12"
    version = _version(".".join(torch.__version__.split("+")[0].split(".")[:2]))
    assert _version(floor) <= version < _version(cap), torch.__version__


def test_pyproject_declares_the_transformers_range_posenc_binds_to():
    assert _declared("transformers", "hf") == {clause.strip() for clause in TRANSFORMERS_RANGE.split(",")}


@pytest.mark.parametrize("extra", ["test", "bench"])
def test_the_references_range_lies_inside_the_bridges_range(extra):
    """The tests' and benches' transformers: the bridge's upper bound, a floor at or above its floor."""
    (hf_floor,) = [c for c in _declared("transformers", "hf") if c.startswith(">=")]
    (hf_cap,) = [c for c in _declared("transformers", "hf") if c.startswith("<")]
    clauses = _declared("transformers", extra)
    (floor,) = [c for c in clauses if c.startswith(">=")]
    assert hf_cap in clauses and _version(floor) >= _version(hf_floor), clauses


@pytest.mark.parametrize("package", ["x-transformers", "rotary-embedding-torch"])
def test_reference_packages_have_both_bounds(package):
    clauses = _declared(package, "test")
    assert any(c.startswith(">=") for c in clauses) and any(c.startswith("<") for c in clauses), clauses


def test_no_extra_installs_a_package_that_repins_torch():
    """timm pulls torchvision, which pins one torch release: no extra may ask for either."""
    for requirement in importlib.metadata.requires("posenc") or []:
        name = requirement.split(";")[0].strip().lower()
        assert not name.startswith(("timm", "torchvision", "torchaudio")), requirement


def test_the_installed_transformers_is_in_the_declared_range():
    transformers = pytest.importorskip("transformers")
    cap, floor = sorted(TRANSFORMERS_RANGE.split(","))  # "<5.25", ">=5.15"
    version = _version(".".join(transformers.__version__.split(".")[:2]))
    assert _version(floor) <= version < _version(cap), transformers.__version__


# ---------------------------------------------------------------------------- import posenc stays light


def test_import_posenc_loads_no_plotting_cli_or_hf_module():
    heavy = ("matplotlib", "rich", "typer", "transformers")
    code = f"import sys, posenc; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"import posenc loaded: {result.stdout.strip()}"
