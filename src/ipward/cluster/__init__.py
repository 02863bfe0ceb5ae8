"""Where ipward reads its cluster from: liveness and pod-metadata sources (the Kubernetes
API in `k8s`; the container runtime and the simulated cluster move in here later)."""
