"""The worker: one process per remote lease, holding that lease's client's tensors on its device."""

import os

# A worker's large host tensors on 2 MiB pages: PyTorch's own switch, read once at its first
# allocation, so set before torch is imported (an operator's setting wins). A CPU worker's fresh
# tensor, a `.to()` from its client or an op's output, then faults its memory in once per 2 MiB
# instead of once per 4 KiB: a 256 MiB host-to-device copy over TCP to a CPU worker went from
# 1.0 to 1.7-2.2 GB/s on a 2-core machine (the link: 2.8 GB/s).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from gpupool.worker.server import Worker, WorkerConfig, run

__all__ = ["Worker", "WorkerConfig", "run"]
