"""Extension by training: continue each trained run at a longer length under a recipe (ABF, PI,
NTK, YaRN, PoSE, CREAM, table interpolation, long layers only) and rank the recipes beyond it.

:mod:`.positions` holds PoSE's and CREAM's position ids, :mod:`.recipes` what each recipe changes,
:mod:`.stage` the stage that runs them over a results folder (``posenc extend``).
"""
