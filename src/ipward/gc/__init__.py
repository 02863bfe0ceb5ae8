"""Garbage collection: which allocation records are leaked, and freeing them safely.
The rules are written once, in `rules`' docstring."""
