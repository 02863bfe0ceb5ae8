"""Node names: they become parts of store keys (`fill/`, `freeq/`, `affinity/`, `nodes/`)
and of records, so every one is checked where it enters (a CNI config's `node`, `ipward
agent --node`) and a stored one that breaks the rule is never trusted (garbage
collection does not judge such a node gone).

Standard library only: the plugin checks its config's node name.
"""

from __future__ import annotations

from ipward.core.errors import InvalidConfig

_NODE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._")
MAX_NODE_NAME = 253


def node_name_problem(name: str) -> str | None:
    """Why `name` cannot be a node's name, or None. Kubernetes node names are DNS
    subdomains (lowercase letters, digits, '-', '.', at most 253); host names that are
    not (upper case, '_') are taken too. Never '/' (store keys are split on it), spaces
    or control characters."""
    if not name:
        return "is empty"
    if len(name) > MAX_NODE_NAME:
        return f"is longer than {MAX_NODE_NAME} characters"
    if not set(name) <= _NODE_CHARS or not (name[0].isalnum() and name[-1].isalnum()):
        return (
            "is not a node name (letters, digits, '-', '.', '_'; a letter or digit first and last)"
        )
    return None


def check_node_name(name: str, field: str) -> str:
    problem = node_name_problem(name)
    if problem:
        raise InvalidConfig(f"{field} {name!r} {problem}")
    return name
