"""gpupool worker."""
