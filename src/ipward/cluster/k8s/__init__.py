"""The Kubernetes API as a cluster source (`k8s://`): objects reduced as parsed
(`objects`), list+watch caches (`reflector`), and the source itself (`source`), over the
API client of `ipward.kubeapi`. docs/design.md 5.13 says why it is built this way."""
