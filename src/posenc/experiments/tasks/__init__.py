"""The tasks a run trains and evaluates on: the registered synthetic tasks and the byte LM
(:mod:`.catalog`), the text corpora (:mod:`.text`) and the retrieval tasks (:mod:`.retrieval`).
"""

# The face hands on :mod:`.catalog`'s public names, listed once, in its ``__all__``.
from .catalog import *  # noqa: F403
from .catalog import __all__  # noqa: F401
