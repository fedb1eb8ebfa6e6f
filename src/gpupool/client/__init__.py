"""gpupool client."""
