"""gpupool: pool every GPU of a cluster and hand out slices or whole GPUs on demand."""

__version__ = "0.1.0"
