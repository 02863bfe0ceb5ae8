"""The cluster controller: one active at a time (`ipward.controller.election`); keeps nodes
warm with blocks, asks surplus blocks back through the hand-back, garbage-collects
leaked records (`passes`); counts (`metrics`). `ipward controller`
(`ipward.cmd.controller`) runs it."""
