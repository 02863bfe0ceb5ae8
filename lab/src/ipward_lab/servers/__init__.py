"""Servers on loopback for the tests, the soak and the bench, and what is done with them:
`etcd` (members and clusters), `kube_test_server` (the test API server: the protocol of
a real kube-apiserver for what ipward uses, with faults on demand), `kube_apiserver` (a
real kube-apiserver on a throwaway etcd), `kube_admin` (plays the rest of a cluster
against either API server; `KubeApi`, a handle on either), `pki` (certificates and
token kubeconfigs)."""
