"""How processes start: a job composed and planned once (job.py), one bootstrap of the ranks of
every command (bootstrap.py), ranks on one machine (local.py), per-node agents, Slurm scripts and
Hydra sweeps."""
