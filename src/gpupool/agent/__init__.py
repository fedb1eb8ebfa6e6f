"""gpupool agent."""
