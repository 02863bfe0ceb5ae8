"""The node agent: serves the CNI plugin over a Unix socket on one long-lived ledger
(`server`, on its socket: `listener`), keeps the node registered and answers hand-backs
(`duties`), reconciles with the runtime (`reconcile`, on its copy of the node's index:
`node_index`), reads pods for ADD (`directory`), counts (`metrics`). `ipward agent`
(`ipward.cmd.agent`) runs it."""
