"""gpupool torch."""
