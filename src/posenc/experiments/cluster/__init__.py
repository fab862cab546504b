"""Runs spread over processes and machines: worker processes (:mod:`.workers`), shards of a grid
(:mod:`.sharding`, :mod:`.shards`: reading one, merging what they wrote) and Slurm submission
(:mod:`.slurm`). What a process reads of where it runs (its device and ``torchrun`` group, Slurm's
environment) is :mod:`posenc.experiments.runtime`, below the results folder and this layer.
"""
