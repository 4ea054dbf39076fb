"""The process world: how a training process joins its peers (:mod:`.distributed`: torchrun,
Slurm or the local launcher's variables, then the default process group) and every reduction it
makes with them (:mod:`.collectives`). The engines and the runtime loop both stand on it."""
