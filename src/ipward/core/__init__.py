"""The core: what every other layer builds on, pure and standard library only (the
plugin's start path imports most of it): address math, pools, the store's key layout
and records, errors, policy, logs, JSON, test points."""
