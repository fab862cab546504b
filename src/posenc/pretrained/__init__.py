"""Trained checkpoints that install offline: the catalog and the fetcher (:mod:`.catalog`), the
conversion and loading into transformers (:mod:`.loading`). ``posenc.pretrained`` hands on the public names.
"""

# The face hands on :mod:`.loading`'s public names, listed once, in its ``__all__``.
from .loading import *  # noqa: F403
from .loading import __all__  # noqa: F401
