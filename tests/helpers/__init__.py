"""Helpers shared by the test modules (no test module imports another; shared code lives here).

- ``checkpoints``: ``record`` (a checkpoint's architecture/layout/training records) and
  ``FakeIO`` (a stand-in engine checkpoint IO).
- ``data_prep``: a real corpus, real tokenizers and a ``python -m data_prep`` runner.
- ``dist``: ``gloo_group`` (1-rank group in-process) and ``run_distributed`` (N worker processes).
- ``engines``: ``cfg_of``, ``fixed_batches`` and ``build`` (an ``engine=megatron`` engine).
- ``gpu``: ``train`` with two ranks on one CUDA GPU (the GPU modules).
- ``megatron_checkpoints``: save, load and train steps of in-process ``engine=megatron`` engines.
- ``models``: ``preset``, ``small`` and ``build`` (Megatron-Core GPTModels), ``in_process``.
- ``signals``: a background 2-rank ``launch`` to signal, ``wait_for``, ``logged_steps``.
- ``slurm``: the one-node Slurm cluster (the ``slurm`` fixture) and job helpers.
- ``submit``: ``HOSTILE`` text and ``hydra_quote``.
- ``training``: ``python -m launcher.train`` on CPU (``train``, ``steps_of``, ``TINY``, ``REPO``).
"""
