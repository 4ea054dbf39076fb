"""The ``mpu`` adapter DeepSpeed takes, over Megatron-Core's parallel state."""

from __future__ import annotations

import torch


class DeepSpeedMPU:
    """The ``mpu`` object DeepSpeed expects, built on ``megatron.core.parallel_state``.

    DeepSpeed calls get_model_parallel_rank/world_size (runtime/engine.py, zero/stage_1_and_2.py),
    which parallel_state lacks. Model parallel = TP x PP; data parallel includes context parallel,
    since CP ranks hold the same parameters and average their gradients with the DP ranks.
    """

    def __init__(self):
        from megatron.core import parallel_state

        self._ps = parallel_state

    def get_model_parallel_group(self):
        return self._ps.get_model_parallel_group()

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank(group=self.get_model_parallel_group())

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size(group=self.get_model_parallel_group())

    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self):
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self):
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_src_rank(self):
        return self._ps.get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_group(self):
        return self._ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_rank(self):
        return self._ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self):
        return self._ps.get_pipeline_model_parallel_world_size()

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group(with_context_parallel=True)

    def get_data_parallel_rank(self):
        return self._ps.get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self):
        return self._ps.get_data_parallel_world_size(with_context_parallel=True)

    def get_data_parallel_group_ranks(self):
        return torch.distributed.get_process_group_ranks(self.get_data_parallel_group())
