"""The worker: one process per remote lease, holding that lease's client's tensors on its device."""

from gpupool.worker.server import Worker, WorkerConfig, run

__all__ = ["Worker", "WorkerConfig", "run"]
