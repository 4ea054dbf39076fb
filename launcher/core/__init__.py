"""The ground floor: what every other layer of trainwright (and data_prep) stands on.

Torch-free and Hydra-free, so a launcher process, a plan or a data_prep run loads it in
milliseconds: exit codes (:mod:`.exits`), the error classes processes exit by (:mod:`.errors`),
the stop contract (:mod:`.stop`), crash-safe writes (:mod:`.atomic`), locks (:mod:`.locks`),
disk-space checks (:mod:`.diskspace`), the step's phase names and timer (:mod:`.phases`), the
problem type every check reports (:mod:`.problems`), the engine and checkpoint protocols
(:mod:`.engine`), the checkpoint directory layout (:mod:`.checkpoints`), and the evaluation's
task files (:mod:`.eval_tasks`: read by data_prep's contamination check too).
Nothing here imports another part of trainwright.
"""
