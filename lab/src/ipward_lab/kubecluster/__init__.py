"""`ipward cluster`: a real Kubernetes cluster on one machine, for the `kube` tests, `ipward
bench --kube` and anyone trying ipward under real kubelets.

A control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler; with
`deploy --store etcd`, a second etcd with TLS for ipward's ledger, outside the cluster as
users run one) in a network namespace of its own, and N worker nodes, each in its own
network namespace and its own private mount namespace with its own containerd and
kubelet. Every namespace is joined to a bridge in a "fabric" namespace by a veth pair.
The namespaces are files in the state dir (`unshare --net=FILE`, `--mount=FILE`), never
`ip netns` names in /run.

The pod network is one, as in a cluster: the network `pods` (`bridge` on each node's
`cni0`, the same gateway 10.244.0.1 on every node, pods on 10.244.0.0/16), with
`proxy_arp` on each `cni0`, so a pod reaches an address of the /16 on another node
through its own node, which routes it. Where an address lives is the routing layer's
business, which the lab plays as a cluster's network would:
- with host-local (`up`), each node hands out its own range (10.244.N.0/24): one static
  route per node's range, in the fabric and in the other nodes (a cloud's route
  controller, from the nodes' pod CIDRs);
- with ipward (`deploy`: its ledger in the API by default, `deploy/base` and an IPPool
  object), one cluster-wide pool `pods` on 10.244.0.0/16, its blocks
  wherever ipward puts them and sticky addresses moving with their pods: a route per
  address, kept by the route syncer (`route_syncer`, a daemon of the lab) from ipward's
  node index, as Calico's or a cloud's route programming follows theirs.

Each node's own directories are bind-mounted over its `/run`, `/var/lib`, `/var/log` and
`/opt` and its `/etc` is an overlay (`nodes`): nothing lands on the machine. Each kubelet
has a cgroup root of its own (cgroups v1 here, made in every hierarchy). No kube-proxy
and no CoreDNS exist here: the API's service address (10.96.0.1:443) is a DNAT rule in
each node namespace, which is all pods and host-network pods need.

Everything the lab makes is written to the state dir's journal (`made.jsonl`) before it
is made, so `down` removes it also after the lab itself crashed: processes (and every
process found in the lab's namespaces or cgroups), namespaces, mounts, cgroups, files.

Modules (each imports only those above it in this list; import from the module that
defines a name):
- `common`: `ClusterError`, a command run, a wait; `layout`: addresses, names, `Node`;
  `prerequisites`: the binaries and tools it needs, where it finds them; `netns`: a
  thread in a network namespace;
- `state`: the state dir (`ClusterState`: cluster.json, the journal, paths);
  `processes`: the lab's daemons and how it knows its processes; `clients`: the API,
  kubectl and the ipward CLI, reached from the control plane's namespace;
- `network`: namespaces, the fabric, node-range routes, the nodes' conflists; `pki`:
  certificates and tokens; `controlplane`: the etcds, the API server, the controllers;
  `nodes`: each node's mounts, cgroups, containerd and kubelet, its runtime's sandboxes,
  its power off and on;
- add-ons: `multus` (Multus's thin plugin), `route_syncer` (the route per pod address,
  the daemon and its control); `deploy`: ipward from its image and deploy/ (`Tuning`);
  `teardown`: `down`, and what tests compare before and after;
- `cluster`: `Cluster`, the facade the users hold; `command`: `ipward cluster`;
  `workloads`: the test pods and their objects; `witness`: what holds which address, read
  from every node's namespaces (`AddressWitness`).
"""
