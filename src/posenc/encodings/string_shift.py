"""STRING: shifted rotary positions (An et al. 2025, "Why Does the Effective Context Length of LLMs
Fall Short?", ICLR 2025, arXiv 2410.18745; code: HKUNLP/STRING ``string_for_llama.py``,
``replace_with_string(max_test_length, shifted_offset, small_local_value)``).

Pretraining leaves the largest relative positions rarely seen. STRING drops them: a query at ``i``
and a key at ``j`` closer than the shift ``S`` (``i - j < S``) keep RoPE's positions ``(i, j)``; farther
pairs take the query at ``i - S + W`` (``W``: the local window), so their relative position
``i - j - S + W`` starts again at ``W`` and the well-trained positions ``W, W + 1, ...`` overwrite the
tail. Nothing is trained; it helps inside the trained length (the paper's RULER results for
Llama 3.1 8B at 128k), and past it once ``S`` is large enough that ``L - 1 - S + W`` stays below the
trained length. One softmax over both parts (:mod:`~posenc.encodings._rope_parts`; the reference
merges two flash attentions by their log-sum-exp).

Conventions:

* The reference's decode step splits the keys at distance ``S`` (the last ``S`` keys near, the others
  shifted), its prefill lets the pair at distance exactly ``S`` into both flash calls (the near one's
  window ``[S, 0]`` keeps distances ``0..S``), counting that key twice. posenc follows the decode
  step everywhere, so a prefill and its cached decode are one computation.
* ``window=shift`` is plain RoPE; ``window`` above ``shift`` is refused (the far part would move to
  positions past the near ones). The reference's defaults are ``shift = 0.33 L`` and ``window = 128``.
* The name ``string`` is STRING-the-rotation (Schenck et al., :mod:`~posenc.encodings.string_rope`);
  this one is ``string_shift``.
* RoPE's options (``base``, ``pairing``, ``rotary_dim``, fixed-length ``scaling``, ...) are those of
  ``rope``. Causal only; shift invariant (both parts depend on ``i - j``).

Backends: eager and the query-blocked ``relative`` backend (CONTENT kind), with the KV cache
(unrotated keys and their positions); for square causal self-attention the ``piecewise`` backend
runs each part on its tiles through the CPU flash kernel (:mod:`posenc.backends.piecewise`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._rope_parts import (
    LOG_SCALE_RANGE,
    ROPE_OPTION_RANGES,
    PartTile,
    PiecewiseRoPE,
    PositionMap,
    window_tiles,
)
from .registry import at_least, register
from .rope import Pairing
from .rope_scaling import RopeScaling

__functional__ = ["string_shift_position_maps"]


def string_shift_position_maps(
    q_pos: Tensor, k_pos: Tensor, shift: int, window: int
) -> tuple[Tensor, list[PositionMap]]:
    """``(part, [near, shifted])``: ``part [B|1, Tq, Tk]`` is 1 where ``i - j >= shift``; the near map
    is ``(i, j)``, the shifted one ``(i - shift + window, j)``."""
    part = (q_pos[..., :, None] - k_pos[..., None, :] >= shift).long()
    return part, [(q_pos, k_pos), (q_pos - (shift - window), k_pos)]


@register("string_shift")
class StringShift(PiecewiseRoPE):
    """STRING (An et al. 2025): RoPE below a shift; beyond it queries move back so well-trained positions replace the tail."""

    shift_invariant = True
    option_ranges = {
        **ROPE_OPTION_RANGES,
        "shift": at_least(1),
        "window": at_least(0),
        "log_scale_length": LOG_SCALE_RANGE,
    }
    example_options: dict[str, Any] = {"shift": 6, "window": 2}

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        shift: int,
        window: int = 128,
        log_scale_length: int | None = None,
        base: float = 10000.0,
        pairing: Pairing = "half",
        rotary_dim: int | None = None,
        partial_rotary_factor: float | None = None,
        scaling: str | RopeScaling | dict | None = None,
        rope_parameters: dict | None = None,
    ) -> None:
        """
        Args:
            head_dim: per-head size (filled in by the attention layer).
            shift: ``S >= 1`` (the reference's ``shifted_offset``, ``0.33 L`` there); pairs at distance
                below it keep RoPE's positions, and it is the number of largest relative positions
                dropped.
            window: ``W`` with ``0 <= W <= S`` (the reference's ``small_local_value``, 128): the relative
                position the shifted part starts at.
            log_scale_length: ``L`` of the optional query scaling ``max(1, log(i+1)/log L)``; None: off.

        ``base``, ``pairing``, ``rotary_dim``, ``partial_rotary_factor``, ``scaling`` and
        ``rope_parameters`` are RoPE's (:class:`~posenc.encodings.rope.RoPE`; fixed-length scalings only).
        """
        if not isinstance(window, int) or isinstance(window, bool) or not isinstance(shift, int):
            raise ValueError(
                f"string_shift: shift and window must be ints, got shift={shift!r}, window={window!r}"
            )
        if window > shift:
            raise ValueError(
                f"string_shift: window={window} must be at most shift={shift} (the shifted part starts at "
                "relative position window, below the near part's shift)"
            )
        super().__init__(
            head_dim,
            log_scale_length,
            base,
            pairing,
            rotary_dim,
            partial_rotary_factor,
            scaling,
            rope_parameters,
        )
        self.shift, self.window = shift, window

    def parts(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, list[PositionMap]]:
        return string_shift_position_maps(q_pos, k_pos, self.shift, self.window)

    def part_tiles(self, first_position: int, length: int) -> list[PartTile]:
        return window_tiles(length, self.shift)

    def preview(self) -> str:
        s, w = self.shift, self.window
        distances = range(0, 2 * s + 3)
        row = [d if d < s else d - s + w for d in distances]
        return f"shift={s}, window={w}: relative position by distance i - j 0..{2 * s + 2}: {row}"
