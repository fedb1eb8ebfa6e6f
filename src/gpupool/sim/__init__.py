"""gpupool sim."""
