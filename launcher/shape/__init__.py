"""The job's shape, torch-free: how the world splits the model and the data
(:class:`ParallelDims`, the pipeline's stage split in :mod:`.stages`), the model as it is built
(:class:`ResolvedModel`) and the batch (:class:`Batch`). The plan derives them from the config
and checks them; the engines build from them; neither reads those config keys again."""

from launcher.shape.batch import Batch
from launcher.shape.dims import MODEL_PARALLEL_SIZES, ParallelDims, cluster_world_size
from launcher.shape.model import ResolvedModel

__all__ = ["Batch", "MODEL_PARALLEL_SIZES", "ParallelDims", "ResolvedModel", "cluster_world_size"]
