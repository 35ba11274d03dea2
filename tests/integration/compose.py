"""Reading docker-compose.yml the way ``docker compose config`` does, for tests on a machine without Docker.

Compose loads the YAML (merge keys included), then interpolates ``${VAR}`` forms in every string value
from the environment. :func:`load_compose` does both; :func:`parse_port` reads the short port syntax;
:func:`redis_directives` turns a ``redis-server --opt value ...`` command into ``{opt: value}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, ${NAME:+alt}, ${NAME+alt}; $NAME; $$
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


class InterpolationError(ValueError):
    """A ``${VAR:?message}`` whose variable is unset, or a ``$`` that starts no variable."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable interpolation of one string value."""

    def replace(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        if match.group("invalid") is not None and match.group("braced") is None and match.group("named") is None:
            raise InterpolationError(f"invalid interpolation format in {text!r}: use $$ for a literal $")
        name = match.group("braced") or match.group("named")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        if op is None:
            return value or ""
        empty_counts = op.startswith(":")  # ':-' treats an empty value like an unset one
        present = value is not None and (value != "" or not empty_counts)
        if op.endswith("-"):
            return value if present else interpolate(arg, env)  # type: ignore[return-value]
        if op.endswith("?"):
            if not present:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return value  # type: ignore[return-value]
        return interpolate(arg, env) if present else ""  # '+'

    return _VAR.sub(replace, text)


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    """Interpolate every string value (not keys) of a loaded YAML tree."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def raw_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a YAML mapping")
    return data


def load_compose(env: Mapping[str, str] | None = None, path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The compose model as Compose sees it with environment ``env`` (empty: every default)."""
    return interpolate_tree(raw_compose(path), env or {})


def variables(path: Path = COMPOSE_FILE) -> dict[str, set[str | None]]:
    """Every variable referenced in the file, with the defaults given for it (None: no default)."""
    found: dict[str, set[str | None]] = {}
    for match in _VAR.finditer(path.read_text()):
        name = match.group("braced") or match.group("named")
        if name is None:
            continue
        op = match.group("op")
        found.setdefault(name, set()).add(match.group("arg") if op in (":-", "-") else None)
    return found


def parse_port(spec: str | int | dict[str, Any]) -> list[tuple[str | None, int, int]]:
    """``[HOST_IP:]HOST[-HOST]:CONTAINER[-CONTAINER][/PROTO]`` -> ``[(host_ip, published, target), ...]``."""
    if isinstance(spec, int):
        return [(None, spec, spec)]
    if isinstance(spec, dict):
        return [(spec.get("host_ip"), int(spec["published"]), int(spec["target"]))]
    body = spec.split("/", 1)[0]
    parts = body.rsplit(":", 2)
    if len(parts) == 1:
        host_ip, published, target = None, parts[0], parts[0]
    elif len(parts) == 2:
        host_ip, (published, target) = None, parts
    else:
        host_ip, published, target = parts
    def span(text: str) -> list[int]:
        lo, _, hi = text.partition("-")
        return list(range(int(lo), int(hi or lo) + 1))
    pub, tgt = span(published), span(target)
    if len(pub) != len(tgt):
        raise ValueError(f"port range {spec!r}: published and target ranges differ in length")
    return [(host_ip, p, t) for p, t in zip(pub, tgt, strict=True)]


def redis_directives(argv: list[str]) -> dict[str, str]:
    """``["redis-server", "--port", "7000", "--save", "", ...]`` -> ``{"port": "7000", "save": "", ...}``."""
    if not argv or argv[0] != "redis-server":
        raise ValueError(f"not a redis-server command: {argv!r}")
    out: dict[str, str] = {}
    args = argv[1:]
    i = 0
    while i < len(args):
        key = args[i]
        if not key.startswith("--"):
            raise ValueError(f"redis-server argument {key!r} is not an --option")
        values = []
        i += 1
        while i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        if key[2:] in out:
            raise ValueError(f"redis-server option {key} given twice")
        out[key[2:]] = " ".join(values)
    return out


def config_directives(text: str) -> dict[str, str]:
    """A redis.conf text -> ``{directive: value}`` with surrounding quotes removed."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        out[key] = value
    return out
