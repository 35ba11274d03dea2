"""Cache keys: ``{name}:{version}:{index}``, with the name and version percent-encoded.

Any string is a valid dataset name or version. The parts are encoded so that a key can always be split
back and matched by pattern: characters outside ``A-Z a-z 0-9 . _ - ~ / + = @`` (among them ``:`` the
separator, ``{ }`` Redis hash tags, ``* ? [ ] \\`` glob characters, ``%`` itself, spaces and non-ASCII) are
written as ``%XX`` of their UTF-8 bytes: ``"my data"`` -> ``my%20data``, ``"ds:v1"`` -> ``ds%3Av1``.
Names made only of the plain characters are their own encoding.

Why not Bagua's ``{dataset_name}_{index}``: ``_`` may appear in names, so ``("a_1", 2)`` and ``("a", "1_2")``
share a key; and there is no version, so a changed dataset would serve stale samples.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

_SAFE = "/+=@"  # on top of the letters, digits and "_.-~" that quote() never encodes


def encode_part(what: str, value: str, allow_empty: bool) -> str:
    """``value`` encoded for a key; raises ``TypeError``/``ValueError`` naming ``what`` when it is unusable."""
    if not isinstance(value, str):
        raise TypeError(f"{what}={value!r} is a {type(value).__name__}; give a string.")
    if not value and not allow_empty:
        raise ValueError(f"{what} is empty; give at least one character.")
    return quote(value, safe=_SAFE, errors="surrogatepass")


def decode_part(raw: str) -> str:
    """Inverse of :func:`encode_part`."""
    return unquote(raw, errors="surrogatepass")


def entry_prefix(name: str, version: str) -> str:
    """The key prefix of the entries of ``name`` at ``version``."""
    return f"{encode_part('dataset_name', name, True)}:{encode_part('version', version, False)}:"
