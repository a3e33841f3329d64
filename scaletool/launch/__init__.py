"""Launching ``scaletool train`` on one node or many: torchrun, the DeepSpeed launcher, Slurm.

- :mod:`.commands`: what to run, as argument lists (never a shell string): the worker command
  ``python -m scaletool train ...``, torchrun's (c10d rendezvous, elastic restarts) and the DeepSpeed
  launcher's (hostfile); plus the environment the node processes need.
- :mod:`.slurm`: an sbatch script rendered from ``slurm.sbatch.j2`` that starts torchrun on every
  node through ``srun``; user strings in it are shell-quoted.
- :mod:`.failures`: turning a failed rank, a rendezvous that never formed, a missing GPU, a
  communication error or an out-of-memory error into one line naming the rank and the cause.
- :mod:`.run`: running those commands and reporting how they ended.
"""
