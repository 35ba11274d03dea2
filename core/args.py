"""argparse argument types shared by every ``bagua-lightning`` subcommand: one rule for ports, counts,
sizes and durations, each refusing bad input with a message naming the value and what to give instead.

They live here, below the command modules, so that the entry point (:mod:`bagua_lightning.cli`) and the
subcommand modules it loads by name both import them from one place and never from each other.
"""

from __future__ import annotations

import argparse

from .addresses import check_port, is_ascii_number
from .errors import ConfigurationError
from .procs import parse_bytes

__all__ = ["bind_port_arg", "non_negative_float_arg", "non_negative_int_arg", "port_arg", "positive_float_arg", "positive_int_arg",
           "size_arg"]


def port_arg(text: str) -> int:
    """argparse type: a TCP port in 1..65535 (:func:`~.addresses.check_port`'s rule)."""
    try:
        return check_port(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def bind_port_arg(text: str) -> int:
    """argparse type: a TCP port to bind, 0..65535 (0: the system picks a free one)."""
    try:
        return check_port(text, bind=True)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def size_arg(text: str) -> int:
    """argparse type: a byte size such as ``1073741824``, ``512mb``, ``4gb`` or ``0``."""
    try:
        return parse_bytes(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def positive_float_arg(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def non_negative_int_arg(text: str) -> int:
    """argparse type: an integer >= 0."""
    if not is_ascii_number(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def positive_int_arg(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not is_ascii_number(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def non_negative_float_arg(text: str) -> float:
    """argparse type: a finite number >= 0 (``0.5``, ``12``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value
