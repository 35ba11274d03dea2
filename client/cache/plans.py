"""Reading cache entries: a skeleton is compiled once into a :class:`Plan`, then every entry with it decodes
with one ``struct`` unpack of its tail and a prebuilt function.

Samples of a dataset almost always share their skeleton (types, dtypes, numbers of dimensions, container
lengths; see :mod:`.values`), so after the first entry a read costs a dict lookup, an unpack and the
construction of the values themselves. Plans are cached per process, at most :data:`MAX_PLANS` of them (the
cache is emptied when full, so hostile entries cannot grow it).

Every check that keeps a damaged or hostile entry from costing more than its own size happens in
:mod:`.plan_compiler` (the readers it nests are made of :mod:`.plan_parts`): the skeleton nests at most
:data:`~.values.MAX_DEPTH` levels, every count is checked against the bytes left before anything is built,
the tail must be exactly as long as the skeleton says, and contents are read through bounds-checked views. Classes of namedtuples and dataclasses are looked up among modules already
imported, at compile time; nothing is ever imported because of an entry.
"""

from __future__ import annotations

from .plan_compiler import _Compiler
from .plan_parts import (
    Build,
    Column,
    NotUniform,
    Plan,
    Rows,
    Vector,
    column_of,
    vector_of,
    with_column,
)

__all__ = [
    "MAX_PLANS",
    "PLANS",
    "Build",
    "Column",
    "NotUniform",
    "Plan",
    "Rows",
    "Vector",
    "column_of",
    "plan_for",
    "vector_of",
    "with_column",
]

MAX_PLANS = 1024

PLANS: dict[bytes, Plan] = {}


def plan_for(skeleton: bytes) -> Plan:
    """The plan of ``skeleton``, compiled on first use."""
    plan = PLANS.get(skeleton)
    if plan is None:
        plan = _Compiler(skeleton).plan()
        plan.skeleton = skeleton
        if len(PLANS) >= MAX_PLANS:
            PLANS.clear()
        PLANS[skeleton] = plan
    return plan
