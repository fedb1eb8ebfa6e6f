"""gpupool controller/routers."""
