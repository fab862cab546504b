"""Attention masks: which keys each query sees, built once per call and read by every backend.

:class:`AttentionMask` (:mod:`.attention_mask`) is the one mask object; its pieces (:mod:`.components`), the
groups of rows that share a mask (:mod:`.groups`), the checks of its keywords (:mod:`.keywords`), the key
segments of a block of rows (:mod:`._segments`) and the three ways a sliding window is counted
(:mod:`.window_conventions`) live beside it. ``posenc.masks`` hands on the public names.
"""

# The face hands on :mod:`.attention_mask`'s public names, listed once, in its ``__all__``.
from .attention_mask import *  # noqa: F403
from .attention_mask import __all__  # noqa: F401
