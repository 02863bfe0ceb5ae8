"""JSON through CPython's C codec (`_json`) without importing the `json` package.

`import json` costs ~6 ms per plugin exec because `json.decoder` compiles regular
expressions (pulling in `re` and `enum`); the C scanner and encoder underneath need
none of that. These two functions drive them the way `json` does for the plain cases
we use: no hooks, strict parsing, compact output. Where `_json` is missing (not CPython),
the `json` package is used instead.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

try:
    import _json
except ImportError:  # pragma: no cover - other interpreters
    _json = None  # type: ignore[assignment]

if _json is None:  # pragma: no cover
    import json as _fallback

    def loads(text: str | bytes) -> Any:
        return _fallback.loads(text)

    def dumps(obj: object, sort_keys: bool = False) -> str:
        return _fallback.dumps(obj, separators=(",", ":"), sort_keys=sort_keys)

else:
    _WHITESPACE = " \t\n\r"
    _CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}

    class _DecoderSettings:
        """The attributes `_json.make_scanner` reads from a `json.JSONDecoder`."""

        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int
        parse_constant = _CONSTANTS.__getitem__
        memo: dict = {}

    _scan = _json.make_scanner(_DecoderSettings())  # type: ignore[arg-type]

    def loads(text: str | bytes) -> Any:
        """Parse one JSON document; raises ValueError (as `json` does) when it is not."""
        if isinstance(text, bytes | bytearray):
            text = text.decode("utf-8")
        start = len(text) - len(text.lstrip(_WHITESPACE))
        try:
            value, end = _scan(text, start)
        except StopIteration as e:
            raise ValueError(f"Expecting value: char {e.value}") from None
        except SystemError:
            # The C scanner builds its error from `json.decoder` only if that module is
            # loaded; on malformed input, load it and let `json` report the error.
            import json

            return json.loads(text)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        if text[end:].strip(_WHITESPACE):
            raise ValueError(f"Extra data: char {end}")
        return value

    def _default(obj: object) -> object:
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    _encoders = {
        sort_keys: _json.make_encoder(
            None,
            _default,
            _json.encode_basestring_ascii,
            None,
            ":",
            ",",
            sort_keys,
            False,
            True,
        )
        for sort_keys in (False, True)
    }

    def dumps(obj: object, sort_keys: bool = False) -> str:
        """Compact JSON text (`separators=(",", ":")`, ASCII)."""
        return "".join(_encoders[sort_keys](obj, 0))
