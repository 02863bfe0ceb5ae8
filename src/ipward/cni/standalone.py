"""The standalone plugin's entry point: `ipward install-cni --standalone` packs it, with
the forwarding path and nothing else (`startpath.STANDALONE_MODULES`), into one executable
for a host that has Python's standard library and no ipward (a Kubernetes node, where
the agent runs in a container).

It sends every call to the node agent named by `ipam.agentSocket`, as the installed
plugin does in cluster mode (`plugin.send`), and answers VERSION itself. It has no
in-process mode (no ledger, no store client): a config that names no agent socket is
refused with code 7 (invalid network configuration), naming `ipam.agentSocket`. Not 11
(retrying the same config cannot help) and not 5 (nothing was tried: the config is what
is wrong, and fixing it is the remedy). A DEL of such a config succeeds unless the
attachment has a note (docs/design.md 5.14): no ADD of it reached an agent.
"""

from __future__ import annotations

import posix

from ipward.cni import notes
from ipward.cni.cniio import check_size, decode, error_output, version_output
from ipward.cni.plugin import attachment_note, configured, finish, read_stdin, send
from ipward.cni.wire import socket_path_problem
from ipward.core.errors import DecodeFailure, InvalidConfig, IpwardError

NO_IN_PROCESS = (
    "this ipward plugin (installed by `ipward install-cni --standalone`) forwards every"
    " call to the node agent and has no in-process mode: set ipam.agentSocket to the"
    " agent's socket (e.g. /run/ipward/agent.sock)"
)


def answer_here(stdin: bytes, command: bytes | None) -> str:
    """The answer to a call that is not forwarded: VERSION's; raises IpwardError for
    anything else (the same checks, in the same order, as the in-process plugin)."""
    check_size(stdin)
    raw = decode(stdin)
    if command == b"VERSION":
        return version_output(raw)
    if raw is None:
        raise DecodeFailure("no network configuration on stdin")
    ipam = raw.get("ipam") if isinstance(raw, dict) else None
    if not isinstance(ipam, dict):
        raise InvalidConfig(f"the 'ipam' section is missing or not an object; {NO_IN_PROCESS}")
    for field in ("agentSocket", "agent_socket"):
        problem = socket_path_problem(ipam[field]) if field in ipam else None
        if problem:
            raise InvalidConfig(f"ipam.{field} {problem}; {NO_IN_PROCESS}")
    if "store" in ipam:
        raise InvalidConfig(f"ipam.agentSocket is missing (ipam.store is ignored); {NO_IN_PROCESS}")
    raise InvalidConfig(f"ipam.agentSocket is missing; {NO_IN_PROCESS}")


def main() -> None:
    stdin = read_stdin()
    command = posix.environ.get(b"CNI_COMMAND")
    path, config = configured(stdin, command)
    if path is not None:
        send(path, stdin, command, config)
    if command == b"DEL" and not notes.held(attachment_note(config)):
        finish(0, b"")  # no ADD of it reached an agent: nothing is held (design 5.14)
    try:
        status, out = 0, answer_here(stdin, command)
    except IpwardError as e:
        status, out = 1, error_output(e, stdin)
    finish(status, out.encode())
