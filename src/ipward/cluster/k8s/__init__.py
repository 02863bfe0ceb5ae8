"""The Kubernetes API as a cluster source (`k8s://`): config (`config`), an HTTP client
over urllib3 (`client`), objects reduced as parsed (`objects`), list+watch caches
(`reflector`), and the source itself (`source`). docs/design.md 5.13 says why it is
built this way."""
