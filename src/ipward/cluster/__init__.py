"""What ipward knows of the cluster: who is alive (liveness sources and their views: the
container runtime over CRI in `cri`, the Kubernetes API in `k8s`, and the schemes other
distributions add), and what an ADD may read of its pod."""
