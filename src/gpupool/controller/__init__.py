"""gpupool controller."""
