"""gpupool cli."""
