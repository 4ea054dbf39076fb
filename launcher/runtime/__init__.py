"""The training runtime: the loop, the checkpoint manager, resume, the run directory and its
session (lock, metrics), data, console."""
