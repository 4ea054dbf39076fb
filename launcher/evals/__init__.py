"""Downstream evaluation: tasks in lm-evaluation-harness's format, read from disk only
(:mod:`launcher.core.eval_tasks`, on the ground floor: data_prep's contamination check reads
them too), scored through a model that any engine runs at any layout
(:mod:`launcher.evals.harness`: lm-evaluation-harness's own request building and metrics, our
scoring), and packed into the engines' fixed-shape micro-batches (:mod:`launcher.evals.rows`).
Torch-free: the runtime (:mod:`launcher.runtime.evaluation`) turns the rows into tensors."""
