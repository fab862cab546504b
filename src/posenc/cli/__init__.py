"""The ``posenc`` command: the app and its top-level commands (:mod:`.app`), and one module per
group of commands (:mod:`.bench`, :mod:`.experiments`, :mod:`.pretrained`, :mod:`.slurm`).
"""

from .app import main

__all__ = ["main"]
