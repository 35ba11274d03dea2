"""Peer selection for the decentralized algorithms: who averages with whom at a given round.

Plain functions of ``(rank, world_size, round)``, so every rank computes the same
pairing without talking to the others, and the logic is testable without
processes. ``rank`` and ``world_size`` are positions among the participants of
the exchange: global ranks for the flat path, node indices for the hierarchical
path (where node leaders exchange on behalf of their nodes).

- ``"all"``: every participant averages with every other one (an allreduce).
- ``"shift_one"``: participants are split into a lower and an upper half; each
  lower-half rank pairs with one upper-half rank, and the pairing shifts by one
  every communication round, so over ``world_size / 2`` rounds every rank meets
  every rank of the other half. Needs an even number of participants.
- ring (low precision decentralized): each participant talks to its left
  (``rank - 1``) and right (``rank + 1``) neighbours, wrapping around.
"""

from __future__ import annotations

from typing import Literal, get_args

from ..core.errors import ConfigurationError

PeerSelectionMode = Literal["all", "shift_one"]
PEER_SELECTION_MODES: tuple[str, ...] = get_args(PeerSelectionMode)


def validate_peer_selection_mode(mode: object) -> PeerSelectionMode:
    """Return ``mode`` if it is a known peer selection mode, else raise a ConfigurationError naming it."""
    if mode not in PEER_SELECTION_MODES:
        raise ConfigurationError(
            f"peer_selection_mode={mode!r} is not supported; choose one of {list(PEER_SELECTION_MODES)}"
        )
    return mode  # type: ignore[return-value]


def check_shift_one_world_size(world_size: int, *, what: str = "world size") -> None:
    """Raise a ConfigurationError unless ``world_size`` can be paired up (even, or a single participant).

    Args:
        world_size: number of participants in the exchange.
        what: how to name the participants in the message ("world size", "number of nodes").
    """
    if world_size < 1:
        raise ValueError(f"{what} must be >= 1, got {world_size}")
    if world_size > 1 and world_size % 2 != 0:
        raise ConfigurationError(
            f'peer_selection_mode="shift_one" pairs ranks two by two and needs an even {what}, '
            f"got {what} {world_size}; run an even number of ranks (nodes when hierarchical=True) "
            'or use peer_selection_mode="all"'
        )


def shift_one_peer(rank: int, world_size: int, round_index: int) -> int:
    """The peer of ``rank`` in communication round ``round_index`` under ``"shift_one"``.

    The pairing is symmetric (``shift_one_peer(shift_one_peer(r)) == r``) and
    changes every round. With a single participant the peer is ``rank`` itself.
    """
    check_shift_one_world_size(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if world_size == 1:
        return rank
    half = world_size // 2
    if rank < half:
        return half + (rank + round_index) % half
    return (rank - half - round_index) % half


def ring_neighbours(rank: int, world_size: int) -> tuple[int, int]:
    """``(left, right)`` neighbours of ``rank`` on a ring of ``world_size`` participants."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    return (rank - 1) % world_size, (rank + 1) % world_size
