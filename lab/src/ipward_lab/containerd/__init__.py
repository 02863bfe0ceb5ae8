"""containerd on this machine, for the labs that run real pods: `config` (containerd 1.6's
configuration), `images` (the pause and sleep images compiled here, the ipward image
built from the checkout's Containerfile) and `lab` (`ContainerdLab`: one containerd with
the CNI plugins for the containerd tests; `machine_lock`, which every lab writing to the
machine's containerd and CNI directories takes). The cluster lab (`ipward_lab.kubecluster`)
runs one containerd per node on `config` and `images`."""
