"""Static pods: a kubelet runs them from files and gives their ADD their own UID (the
config hash); the API lists only their mirror pods, of another UID, carrying that one in
the annotation `kubernetes.io/config.mirror`. Here: the test API server checks that
annotation as the real kube-apiserver does (the `kube` fixture runs on both)."""

from __future__ import annotations

import pytest

from conftest import KubeApi
from ipward.cluster.k8s.client import ApiError
from ipward.cluster.liveness import MIRROR_ANNOTATION


def test_a_mirror_pods_annotation_is_checked_as_the_real_server_does(kube: KubeApi) -> None:
    """The test server answers like kube-apiserver 1.26: a mirror pod names its node,
    and its annotation is never added, changed or removed (422 Invalid)."""
    ns, node = kube.name("mirror-rules"), kube.name("n1")
    kube.admin.namespace(ns)
    body = {
        "metadata": {"name": "unbound", "annotations": {MIRROR_ANNOTATION: "h1"}},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/pause:1"}]},
    }
    with pytest.raises(ApiError) as unbound:
        kube.client.request("POST", f"/api/v1/namespaces/{ns}/pods", body=body)
    assert (unbound.value.status, unbound.value.reason) == (422, "Invalid")
    assert unbound.value.message == (
        f'Pod "unbound" is invalid: metadata.annotations[{MIRROR_ANNOTATION}]: Invalid value:'
        ' "h1": must set spec.nodeName if mirror pod annotation is set'
    )
    kube.admin.pod(ns, "mirror", node, annotations={MIRROR_ANNOTATION: "h1"})
    kube.admin.pod(ns, "plain", node)
    for name, value, what in (
        ("plain", "h1", "may not add"),
        ("mirror", "h2", "may not remove or update"),
        ("mirror", None, "may not remove or update"),
    ):
        with pytest.raises(ApiError) as refused:
            kube.admin.annotate_pod(ns, name, {MIRROR_ANNOTATION: value})
        assert (refused.value.status, refused.value.reason) == (422, "Invalid")
        assert refused.value.message == (
            f'Pod "{name}" is invalid: metadata.annotations[{MIRROR_ANNOTATION}]: Forbidden:'
            f" {what} mirror pod annotation"
        )
        (cause,) = refused.value.body["details"]["causes"]
        assert cause["field"] == f"metadata.annotations[{MIRROR_ANNOTATION}]"
    kube.admin.annotate_pod(ns, "mirror", {"ipward.io/pool": "p"})  # other annotations may
