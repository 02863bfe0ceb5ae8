"""IP address management over the store: the ledger (allocate, free) and its parts,
blocks and their hand-back, pools' lives, the invariant checker, export and import.
Kept empty: the plugin imports the ledger on every in-process call."""
