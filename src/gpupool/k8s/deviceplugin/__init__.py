"""The kubelet device plugin (device-plugin API v1beta1) that the agent serves."""
