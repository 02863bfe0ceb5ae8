"""What the plugin reads and prints without the ledger: the network configuration on
stdin (its size, its JSON), VERSION's answer and the CNI error object. The in-process
plugin (`cni`) and the forwarding path (`plugin`) share these, so each answers the same
input the same way; the native plugin (`cni/native`) answers as they do, in the same
words. Standard library only, nothing costly to import."""

from __future__ import annotations

from ipward.cni.wire import MAX_CONFIG
from ipward.core.errors import DecodeFailure, InputTooLarge, IpwardError
from ipward.core.startpath import json_dumps, json_loads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
MAX_MESSAGE = 2000  # characters of an error's msg (and details): messages quote input


def check_size(stdin: bytes) -> None:
    if len(stdin) > MAX_CONFIG:
        raise InputTooLarge(
            f"network configuration on stdin is larger than the limit of {MAX_CONFIG} bytes"
        )


def decode(stdin: bytes) -> Any:
    """The parsed configuration (None for an empty stdin); DecodeFailure if not JSON."""
    try:
        return json_loads(stdin) if stdin.strip() else None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise DecodeFailure(f"network configuration on stdin is not JSON: {e}") from None


def dump(obj: dict) -> str:
    return json_dumps(obj) + "\n"


def version_output(raw: object) -> str:
    """VERSION's answer to the parsed configuration `raw` (it needs no store or agent)."""
    requested = raw.get("cniVersion", "1.1.0") if isinstance(raw, dict) else "1.1.0"
    return dump({"cniVersion": requested, "supportedVersions": list(SUPPORTED_VERSIONS)})


def _error_version(stdin: bytes) -> str:
    """The cniVersion to answer an error in (parsed again only on the error path)."""
    version = None
    if len(stdin) <= MAX_CONFIG:
        try:
            version = json_loads(stdin).get("cniVersion")
        except Exception:  # whatever the input: an error answer must still go out
            version = None
    return version if version in SUPPORTED_VERSIONS else SUPPORTED_VERSIONS[-1]


def error_output(error: IpwardError, stdin: bytes) -> str:
    """What the plugin prints for `error`: the CNI error object, in the cniVersion the
    config on `stdin` asks for if we support it (else the latest). Messages quote the
    input, so msg and details are cut to MAX_MESSAGE characters."""
    out = error.to_cni(_error_version(stdin))
    for field in ("msg", "details"):
        if len(out.get(field, "")) > MAX_MESSAGE:
            out[field] = out[field][:MAX_MESSAGE] + " [...]"
    return dump(out)
