"""How processes start: Slurm scripts, per-node agents and Hydra sweeps."""
