"""Reliability tests ("nothing silent"): each case a realistic misuse that once gave a wrong result
without an error, one file per component.

Every test asserts either the clear error (naming the parameter, file or object at fault) or the
correct result, computed independently (a fresh cache, a separate layer, the eager backend, HF's
functions, tables or closed forms).

* ``test_request.py``: ``AttentionRequest``, choosing a backend, masks and the kernels.
* ``test_layer.py``: ``MultiheadAttention``'s arguments, positions, devices, ``torch.compile``.
* ``test_cache.py``: ``KVCache``, ``LatentCache``, windows, streaming.
* ``test_encodings.py``: option ranges (generated from the registry), sizes, RoPE's pairing switch,
  p-RoPE.
* ``test_runs.py``: an experiment's inputs, damaged checkpoints, killed processes.
* ``test_results.py``: results folders, merge, report, compare, intervals, the CLI's errors.
* ``test_commands.py``: ``posenc plot`` and ``posenc show``.
* ``test_hf.py``: ``posenc.hf`` (marked ``hf``).
"""
