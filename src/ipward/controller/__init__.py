"""The cluster controller: one active at a time (leader election); keeps nodes warm with
blocks, asks surplus blocks back through the hand-back, garbage-collects leaked records."""
