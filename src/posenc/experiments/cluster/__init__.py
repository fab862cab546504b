"""Runs spread over processes and machines: worker processes (:mod:`.workers`), torch.distributed
(:mod:`.distributed`), shards of a grid (:mod:`.sharding`, :mod:`.shards`) and Slurm (:mod:`.slurm`, :mod:`.slurm_env`).
"""
