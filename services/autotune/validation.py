"""The one check of names that arrive in requests (model and tensor names).

A name ends up in log lines, the per-model sample log, metric labels and the
``autotune ls`` table: a newline or NUL in it forges lines there. Names with a
control or format character (Unicode categories Cc, Cf), a line or paragraph
separator (Zl, Zp) or a lone surrogate (Cs) are refused with INVALID_ARGUMENT;
names longer than ``max_bytes`` in UTF-8 with RESOURCE_EXHAUSTED (a size limit,
raised with ``--max-name-bytes``).
"""

from __future__ import annotations

import unicodedata

from .errors import InvalidArgumentError, ResourceExhaustedError

REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _first_refused(name: str) -> tuple[int, str] | None:
    """(index, category) of the first refused character of ``name``; None when it has none."""
    if name.isprintable():  # C fast path: printable strings hold no Cc/Cf/Cs/Zl/Zp character
        return None
    for i, ch in enumerate(name):
        category = unicodedata.category(ch)
        if category in REFUSED_CATEGORIES:
            return i, category
    return None


def check_name(what: str, name: str, max_bytes: int) -> None:
    """Refuse a model or tensor name the service cannot show or log safely.

    Args:
        what: the field, as the error names it (``"model_name"``, ``"tensor_list[3].name"``).
        name: the value.
        max_bytes: longest accepted name in UTF-8 bytes.

    Raises:
        InvalidArgumentError: empty, or holds a control/format character.
        ResourceExhaustedError: longer than ``max_bytes``.
    """
    if not name:
        raise InvalidArgumentError(f"{what} is empty; give a non-empty name")
    if 4 * len(name) > max_bytes:  # UTF-8 takes at most 4 bytes per character: only long names are encoded
        size = len(name.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise ResourceExhaustedError(
                f"{what} is {size} bytes long ({name[:40]!r}...), more than the service's limit of "
                f"{max_bytes}; use a shorter name or raise --max-name-bytes")
    refused = _first_refused(name)
    if refused is not None:
        index, category = refused
        raise InvalidArgumentError(
            f"{what} {name[:80]!r} holds the control character {name[index]!r} (U+{ord(name[index]):04X}, "
            f"category {category}) at index {index}; names must be printable (no newline, NUL, tab or other "
            "control/format characters): rename it")
