"""The core: what every other layer builds on, standard library only (the plugin's start
path imports most of it): address math, pools, the store's key layout and records,
errors, policy, logs, test points, and the start path itself (`startpath`: the launcher
and its code pack, JSON and SQLite imported cheaply, the native plugin's install)."""
