"""gpupool controller/background."""
