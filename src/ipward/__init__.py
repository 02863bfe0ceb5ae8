"""ipward: a cluster-wide IP address manager for container networks.

Kept empty on purpose: the CNI plugin imports `ipward.cni.plugin` on every pod start, and
whatever this file imports is paid for on that path.
"""
