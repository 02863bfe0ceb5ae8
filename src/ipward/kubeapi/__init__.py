"""The Kubernetes API client: where the API is and who we are (`config`: in-cluster or a
kubeconfig), and requests and watch streams over one kept connection pool (`client`).
Below the store (the `k8s://` store keeps the ledger in the API) and the cluster
sources (the `k8s://` liveness source reads pods and nodes through it)."""
