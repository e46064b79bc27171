"""Test support: local stand-ins for outside systems that cannot run on the test machines.

``kubeapi``  an emulated Kubernetes API server over HTTP, driven by the real kubernetes_asyncio
             client (no kube-apiserver, Docker or kind can run where the tests run).
"""
