"""gpupool controller/services."""
