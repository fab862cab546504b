"""Pieces the backends share: facts about PyTorch's CPU flash kernel (:mod:`.flash`), the exact
log-sum-exp merge of attention parts (:mod:`.exact`), what a query-blocked call cannot run
(:mod:`.query_blocks`), attention sinks (:mod:`.sinks`), logit soft-capping (:mod:`.softcap`) and
the near band of the ``clipped`` split (:mod:`.clipped_near`). None of them is a backend."""
