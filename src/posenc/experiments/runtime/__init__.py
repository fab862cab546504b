"""Where this process runs, read from its environment: the device and the ``torchrun`` process group
(:mod:`.distributed`), and Slurm's job, array task and rendezvous (:mod:`.slurm_env`).

The lowest room of the experiments: it imports no sibling. The results folder's lock asks it whether
the Slurm job that holds a lock still runs, training and the study ask it for their device, and the
cluster layer (:mod:`posenc.experiments.cluster`: workers, submission, merging) builds on it.
"""
