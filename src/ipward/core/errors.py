"""ipward's errors, each with its CNI error code, so no error can forget its code.

Codes 1-99 are the CNI spec's; 100 and up are ipward's own, documented in the README.
The CLI prints the same `msg` (and `details`) without a traceback.
"""

from __future__ import annotations


class IpwardError(Exception):
    code = 999
    retryable = False

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details

    def to_cni(self, cni_version: str) -> dict:
        out = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out


class IncompatibleVersion(IpwardError):
    code = 1


class UnknownContainer(IpwardError):
    code = 3


class InvalidEnvironment(IpwardError):
    code = 4


class IoFailure(IpwardError):
    code = 5


class DecodeFailure(IpwardError):
    code = 6


class InvalidConfig(IpwardError):
    code = 7


class PoolsOverlap(InvalidConfig):
    """A pool would cover an address another pool covers (docs/design.md invariant 10);
    `other` names that pool."""

    def __init__(self, msg: str, other: str) -> None:
        super().__init__(msg)
        self.other = other


class PoolExists(InvalidConfig):
    """A pool of that name is already stored."""


class TryAgainLater(IpwardError):
    """The store or agent is unreachable or too busy; nothing was changed."""

    code = 11
    retryable = True


class NotAvailable(IpwardError):
    """STATUS: the plugin cannot serve ADDs right now."""

    code = 50
    retryable = True


class PoolExhausted(IpwardError):
    code = 100


class AddressTaken(IpwardError):
    code = 101


class AddressOutsidePool(IpwardError):
    code = 102


class UnknownPool(IpwardError):
    code = 103


class OwnerChanged(IpwardError):
    """A compare-and-delete found the record changed since it was read."""

    code = 104


class PoolNotAllowed(IpwardError):
    """The pool chosen for the pod does not serve its namespace or its node."""

    code = 105


class IncompatibleStore(IpwardError):
    """The store is not usable by this code: not an ipward store (another program's
    file or database), a newer schema, an older one not migrated, an import in
    progress. Permanent: trying again cannot help."""

    code = 106


class InputTooLarge(IpwardError):
    """Input over a documented size limit: the network config, a request to the agent, or
    an allocation too large for one store transaction. Retrying cannot help."""

    code = 107


CODES = {
    cls.code: cls
    for cls in (
        IncompatibleVersion,
        UnknownContainer,
        InvalidEnvironment,
        IoFailure,
        DecodeFailure,
        InvalidConfig,
        TryAgainLater,
        NotAvailable,
        PoolExhausted,
        AddressTaken,
        AddressOutsidePool,
        UnknownPool,
        OwnerChanged,
        PoolNotAllowed,
        IncompatibleStore,
        InputTooLarge,
    )
}
