"""gpupool inside Kubernetes: device plugin, scheduler extender, admission webhook."""
