"""The cluster lab's deploy, the parts that need no cluster: the pool `pods` a tuning
makes, as an IPPool's spec (k8s://) and as `ipward pool create`'s options (etcd)."""

from __future__ import annotations

import pytest

from ipward_lab.kubecluster.common import ClusterError
from ipward_lab.kubecluster.deploy import pool_create_args, pool_spec

TUNED = {"blockSize": {"ipv4": 29}, "warm": 4, "releaseDelaySeconds": 5, "cooldownSeconds": 2}


def test_a_tuning_is_the_same_pool_on_either_store() -> None:
    assert pool_spec(TUNED) == {
        "ranges": [{"subnet": "10.244.0.0/16", "gateway": "10.244.0.1"}],
        **TUNED,
    }
    assert pool_create_args(TUNED) == [
        "--block-v4=29",
        "--warm=4",
        "--release-delay=5",
        "--cooldown=2",
    ]


def test_a_field_the_cli_has_no_option_for_is_refused_by_name() -> None:
    with pytest.raises(ClusterError, match="routes"):
        pool_create_args({"routes": [{"dst": "0.0.0.0/0"}]})
