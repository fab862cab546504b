"""The backends package's seams (issue 34, item 2): the protocol declares what dispatch reads, the
CPU flash limit has one wording, and the splits read their shared limits from one module, not
from another backend.

Expected values are written here: the protocol's defaults, the reason strings of the one wording
(read from ``cpu_flash_limit`` once and required verbatim of every backend), the import graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import posenc
import posenc.backends as backends
from posenc.backends import (
    INPUT_BIAS_REASON,
    SOFTCAP_REASON,
    AttentionRequest,
    Backend,
    backend_limits,
    get_backend,
    register_backend,
)
from posenc.encodings.base import TokenStates

HEADS, DIM, T = 2, 8, 8


class _Plain:
    """A backend that declares none of the protocol's flags."""

    name = "plain_test_backend"

    def reasons(self, request):
        return []

    def declines(self, request):
        return []

    def run(self, request):
        raise AssertionError("never runs")


@pytest.fixture
def registered():
    """Register backends for one test and take them out again (the registry is global)."""
    added: list[str] = []

    def add(backend):
        added.append(backend.name)
        return register_backend(backend)

    yield add
    for name in added:
        backends._BACKENDS.pop(name, None)
    backends._memo.bump()


def test_the_protocol_declares_the_flags_dispatch_reads(registered):
    """``serves_input_bias`` and ``serves_softcap`` are Backend attributes, False by default; a backend
    registered without them gets the defaults, so backend_limits reads them as plain attributes and
    refuses a soft-capped or input-dependent request for it."""
    assert Backend.serves_input_bias is False and Backend.serves_softcap is False
    plain = registered(_Plain())
    assert plain.serves_input_bias is False and plain.serves_softcap is False
    q = torch.randn(1, HEADS, T, DIM)
    pos = torch.arange(T)[None]
    capped = AttentionRequest(
        q=q, k=q, v=q, encoding=posenc.build("nope"), q_pos=pos, k_pos=pos, scale=0.3, softcap=30.0
    )
    assert backend_limits(plain, capped) == [SOFTCAP_REASON]
    fox = posenc.MultiheadAttention(HEADS * DIM, HEADS, "fox", causal=True).encoding
    states = TokenStates.same_sequence(fox.token_states(torch.randn(1, T, HEADS * DIM)))
    gated = AttentionRequest(
        q=q, k=q, v=q, encoding=fox, q_pos=pos, k_pos=pos, scale=0.3, token_states=states
    )
    assert backend_limits(plain, gated) == [INPUT_BIAS_REASON]
    assert backend_limits(get_backend("eager"), gated) == []  # eager declares it serves input biases


def test_a_backend_that_takes_no_flag_is_refused_naming_the_flag(registered):
    class Slotted:
        __slots__ = ()
        name = "slotted_test_backend"
        reasons = declines = run = _Plain.reasons

    with pytest.raises(TypeError, match="lacks serves_dropout and takes no attribute"):
        registered(Slotted())


def test_no_backend_imports_another_backend():
    """The splits read the limits they share with ``blocked`` from ``_query_blocks`` (and the flash
    kernel's from ``_flash``): no backend module imports from another backend module."""
    folder = Path(backends.__file__).parent
    # modules that serve the backends (the memo, the finite checks, the soft-cap check are read by
    # the layers and the HF bridge too, hence public) and are no backend themselves
    not_backends = {"dispatch", "run", "request", "memo", "finite", "softcap"}
    public = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")} - not_backends
    found = []
    for path in sorted(folder.glob("*.py")):
        if path.stem in ("run", "dispatch"):  # above the backends: they may name one
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in public:
                found.append(f"{path.name} imports from .{node.module}")
    assert "blocked" in public and "near_far" in public
    assert found == []
