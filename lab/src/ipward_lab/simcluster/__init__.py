from ipward_lab.simcluster.model import SimCluster

__all__ = ["SimCluster"]
