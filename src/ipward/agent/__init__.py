"""The node agent: serves the CNI plugin over a Unix socket on one long-lived ledger,
keeps the node registered and answers hand-backs, reconciles with the runtime."""
