"""What ``algorithm="auto"`` measured and kept for a job, as the service holds, shows and stores it.

Checked once, on entry (:meth:`AlgorithmChoice.of`): algorithm names end up in metric labels, log lines and
the ``autotune show`` table, so they are plain identifiers, and every number is range-checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError

MAX_CANDIDATES = 16
MAX_REASON_BYTES = 1024
MAX_STEP_MS = 1e7  # milliseconds (as the service's other durations)
MAX_STEP = 1 << 62
_ALGORITHM = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _check_algorithm(what: str, name: str) -> str:
    if not isinstance(name, str) or _ALGORITHM.fullmatch(name) is None:
        raise InvalidArgumentError(f"{what} {str(name)[:80]!r} is not an algorithm name; give Bagua's name "
                                   "(lower-case letters, digits and '_', at most 64, e.g. 'bytegrad')")
    return name


@dataclass(frozen=True, slots=True)
class AlgorithmChoice:
    """One job's ``algorithm="auto"`` selection.

    Attributes:
        chosen: the candidate kept.
        step_ms: each candidate's measured step time (median, slowest rank) in milliseconds, in measured order.
        reason: one line saying why.
        step: the training step every rank switched at.
        job_id: the job that reported it ("" without a job id).
    """

    chosen: str
    step_ms: tuple[tuple[str, float], ...]
    reason: str
    step: int
    job_id: str = ""

    @classmethod
    def of(cls, chosen: str, step_ms: Sequence[tuple[str, float]], reason: str, step: int,
           job_id: str = "") -> AlgorithmChoice:
        """A checked choice; InvalidArgumentError names the field, the value and the fix."""
        if not step_ms:
            raise InvalidArgumentError("selection.candidates is empty; send every candidate measured with its "
                                       "step time")
        if len(step_ms) > MAX_CANDIDATES:
            raise InvalidArgumentError(f"selection.candidates has {len(step_ms)} entries, more than "
                                       f"{MAX_CANDIDATES}; algorithm='auto' measures fewer candidates")
        seen: set[str] = set()
        for i, (name, ms) in enumerate(step_ms):
            _check_algorithm(f"selection.candidates[{i}].algorithm", name)
            if name in seen:
                raise InvalidArgumentError(f"selection.candidates[{i}].algorithm {name!r} is a duplicate; "
                                           "send each candidate once")
            seen.add(name)
            if not (isinstance(ms, int | float) and math.isfinite(ms) and 0 < ms <= MAX_STEP_MS):
                raise InvalidArgumentError(f"selection.candidates[{i}].step_ms={ms!r} for {name!r}: a step time "
                                           f"must be finite, > 0 and at most {MAX_STEP_MS:g} ms")
        _check_algorithm("selection.chosen", chosen)
        if chosen not in seen:
            raise InvalidArgumentError(f"selection.chosen {chosen!r} is not among the candidates "
                                       f"{sorted(seen)}; send the candidate that was kept")
        if not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise InvalidArgumentError(f"selection.step={step!r}: give the training step it was decided at "
                                       f"(0..2**62)")
        if len(reason.encode("utf-8", "surrogatepass")) > MAX_REASON_BYTES or (reason and not reason.isprintable()):
            raise InvalidArgumentError(f"selection.reason {reason[:80]!r} must be one printable line of at most "
                                       f"{MAX_REASON_BYTES} bytes")
        return cls(chosen=chosen, step_ms=tuple((n, float(ms)) for n, ms in step_ms), reason=reason, step=step,
                   job_id=job_id)

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "step_ms": [[n, ms] for n, ms in self.step_ms], "reason": self.reason,
                "step": self.step, "job_id": self.job_id}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AlgorithmChoice:
        """Parse a stored choice (checked as a request is); ValueError/KeyError/TypeError when malformed."""
        pairs = [(str(n), float(ms)) for n, ms in data["step_ms"]]
        return cls.of(str(data["chosen"]), pairs, str(data.get("reason", "")), int(data["step"]),
                      job_id=str(data.get("job_id", ""))[:1024])
