"""The training runtime: the loop, its collectives, checkpoints, data, metrics and stop requests."""
