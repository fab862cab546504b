"""STRING (``string_shift``) against HKUNLP/STRING's ``string_for_llama.py``, restated here on its own.

The reference's decode step (``has_kv_cache``): keys and queries rotated with HF's tables, the query
at ``position_ids`` against the last ``diag_size`` keys (``k_cache[shifted_size:]``) and at
``position_ids - diag_size + local_window`` against the others (``k_cache[:shifted_size]``), the two
flash-decoding outputs merged by their log-sum-exp (``1 / (1 + exp(lse2 - lse1))``). Its prefill runs
flash attention with a near window ``[diag_size, 0]``, which lets the key at distance exactly
``diag_size`` into both calls: posenc follows the decode step, and the test shows the prefill's
double count on that one diagonal and nowhere else. Logits and outputs in float64.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from _piecewise_rope import HEAD_DIM, max_diff, qk, rope

SCALE = HEAD_DIM**-0.5


def _lse_merge(out1, lse1, out2, lse2):
    """The reference's merge of two attention outputs by their log-sum-exp."""
    gap21 = 1 / (1 + torch.exp(lse2 - lse1))
    gap12 = 1 / (1 + torch.exp(lse1 - lse2))
    return out1 * gap21 + out2 * gap12


def _attend(q, k, v):
    logits = q @ k.transpose(-1, -2) * SCALE
    return logits.softmax(-1) @ v, torch.logsumexp(logits, dim=-1, keepdim=True)


def reference_decode_row(q, k, v, i: int, diag_size: int, local_window: int):
    """Output of the query at ``i`` (keys 0..i, all rotated at their positions), as the decode step."""
    kv_len = i + 1
    shifted_size = kv_len - diag_size
    k_rot = rope(k[:, :, :kv_len], torch.arange(kv_len))
    q1 = rope(q[:, :, i : i + 1], torch.tensor([i]))
    out1, lse1 = _attend(q1, k_rot[:, :, max(shifted_size, 0) :], v[:, :, max(shifted_size, 0) : kv_len])
    if shifted_size <= 0:
        return out1
    q2 = rope(q[:, :, i : i + 1], torch.tensor([i - diag_size + local_window]))
    out2, lse2 = _attend(q2, k_rot[:, :, :shifted_size], v[:, :, :shifted_size])
    return _lse_merge(out1, lse1, out2, lse2)


def _posenc_output(spec: str, q, k, v):
    encoding = posenc.build(spec, head_dim=HEAD_DIM)
    positions = torch.arange(q.shape[2])[None]
    logits = encoding.logits(q, k, positions, positions, scale=SCALE)
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1) @ v, logits


@pytest.mark.parametrize(
    ("length", "shift", "window"), [(29, 7, 2), (29, 7, 0), (29, 7, 7), (9, 12, 3), (40, 1, 1)]
)
def test_each_query_equals_the_reference_decode_step(length, shift, window):
    q, k = qk(2, length, seed=3)
    v = torch.randn_like(k)
    got, _ = _posenc_output(f"string_shift:shift={shift},window={window}", q, k, v)
    for i in range(length):
        want = reference_decode_row(q, k, v, i, shift, window)
        assert max_diff(got[:, :, i : i + 1], want) < 1e-5, i  # float32 angles, rounded through other rows


def test_the_logits_are_rope_at_the_shifted_relative_positions():
    """Written as positions: near ``(i, j)``, far ``(i - S + W, j)``, both through HF's rotation."""
    length, shift, window = 25, 6, 2
    q, k = qk(1, length, seed=5)
    _, got = _posenc_output(f"string_shift:shift={shift},window={window}", q, k, torch.randn_like(k))
    positions = torch.arange(length)
    near = rope(q, positions) @ rope(k, positions).transpose(-1, -2) * SCALE
    far = rope(q, positions - shift + window) @ rope(k, positions).transpose(-1, -2) * SCALE
    distance = positions[:, None] - positions[None]
    want = torch.where(distance >= shift, far, near)
    causal = distance >= 0
    assert max_diff(got[..., causal], want[..., causal]) < 1e-12


def test_the_reference_prefill_counts_the_key_at_distance_shift_twice():
    """The prefill's near window [S, 0] keeps distances 0..S, its shifted call distances >= S: that
    one diagonal is in both softmaxes. posenc (the decode step's split) differs there only."""
    length, shift, window = 20, 5, 2
    q, k = qk(1, length, seed=6)
    v = torch.randn_like(k)
    got, _ = _posenc_output(f"string_shift:shift={shift},window={window}", q, k, v)
    positions = torch.arange(length)
    distance = positions[:, None] - positions[None]
    near = rope(q, positions) @ rope(k, positions).transpose(-1, -2) * SCALE
    far = rope(q, positions - shift + window) @ rope(k, positions).transpose(-1, -2) * SCALE
    near_out, near_lse = _attend_masked(near, v, (distance >= 0) & (distance <= shift))
    far_out, far_lse = _attend_masked(far, v, distance >= shift)
    rows = positions >= shift
    prefill = near_out.clone()
    prefill[..., rows, :] = _lse_merge(near_out, near_lse, far_out, far_lse)[..., rows, :]
    assert max_diff(prefill[..., :shift, :], got[..., :shift, :]) < 1e-5  # no far key yet: equal
    assert max_diff(prefill[..., shift:, :], got[..., shift:, :]) > 1e-3  # the doubled key shows


def _attend_masked(logits, v, allowed):
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.nan_to_num(logits.softmax(-1)) @ v, lse


def test_window_equal_to_shift_is_rope():
    q, k = qk(1, 17, seed=7)
    v = torch.randn_like(k)
    got, _ = _posenc_output("string_shift:shift=4,window=4", q, k, v)
    want, _ = _posenc_output("string_shift:shift=100,window=0", q, k, v)  # every pair near
    assert max_diff(got, want) < 1e-5


def test_the_default_window_is_the_reference_s_local_value():
    assert posenc.build("string_shift:shift=1000", head_dim=HEAD_DIM).window == 128  # small_local_value
    with pytest.raises(ValueError, match="window=128 must be at most shift=64"):
        posenc.build("string_shift:shift=64", head_dim=HEAD_DIM)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("string_shift", "shift"),
        ("string_shift:shift=4,window=5", "window=5 must be at most shift=4"),
        ("string_shift:shift=0,window=0", "shift"),
        ("string_shift:shift=4,window=-1", "window"),
    ],
)
def test_bad_options_are_refused_by_name(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        posenc.build(spec, head_dim=HEAD_DIM)
