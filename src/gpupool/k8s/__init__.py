"""gpupool k8s."""
