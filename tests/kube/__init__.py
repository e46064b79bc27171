"""Kubernetes mode and the emulated API server it is tested against."""
