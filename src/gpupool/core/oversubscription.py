"""Memory oversubscription: which sessions of a GPU give way when it runs short of memory.

With a memory ratio above 1 the pool grants remote slices more memory than a GPU has, trusting
that not every session holds its whole grant at once. When one does, and an allocation that
fits its lease's own limit does not fit the GPU's free memory, some other sessions of that GPU
are swapped out to host memory (as idle release does) and the allocation waits for the room.
Nobody is killed for another's allocation: a victim resumes at its next op, here or elsewhere.

The policy, `choose_victims`, is deterministic and documented in docs/elastic.md:

1. Only remote sessions that hold device memory now can give way: a direct lease's process
   cannot be swapped, the requester never gives way to itself, a swapped session holds none.
2. Idle sessions (no GPU op for `idle_after_s`) give way whatever their priority; a busy
   session only for a requester of strictly higher priority (equal priorities do not take
   turns swapping each other out, which would thrash).
3. In order: idle before busy; then lower priority first; then least recently active first
   (the most recently active goes last); then the larger holder first (fewer swaps); then by
   lease id, so equal inputs give equal answers.
4. Victims are taken in that order until their memory covers the shortfall; if all the
   candidates together cannot cover it, nobody is swapped and the allocation fails with the
   lease's OutOfMemoryError (swapping without making room would only hurt the others).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpupool.core.model import Access

IDLE_AFTER_S = 5.0
"""A session with no GPU op for this long counts as idle for the oversubscription policy."""


@dataclass(frozen=True)
class Session:
    """One lease's presence on a GPU, as its worker reports it."""

    lease_id: str
    access: Access
    priority: int
    held_mib: int
    """Device memory the session holds now (0 when swapped out)."""
    last_active_s: float
    """When it last ran a GPU op (any monotonic clock shared by the sessions compared)."""
    swapped: bool = False


def is_idle(session: Session, now_s: float, idle_after_s: float = IDLE_AFTER_S) -> bool:
    return now_s - session.last_active_s >= idle_after_s


def candidates(
    sessions: Iterable[Session],
    requester: Session,
    now_s: float,
    idle_after_s: float = IDLE_AFTER_S,
) -> list[Session]:
    """Sessions that may give way to `requester`, in the order they do (rules 1 to 3)."""
    eligible = [
        s
        for s in sessions
        if s.lease_id != requester.lease_id
        and s.access is Access.REMOTE
        and not s.swapped
        and s.held_mib > 0
        and (is_idle(s, now_s, idle_after_s) or s.priority < requester.priority)
    ]
    return sorted(
        eligible,
        key=lambda s: (
            not is_idle(s, now_s, idle_after_s),
            s.priority,
            s.last_active_s,
            -s.held_mib,
            s.lease_id,
        ),
    )


def choose_victims(
    sessions: Iterable[Session],
    requester: Session,
    needed_mib: int,
    now_s: float,
    idle_after_s: float = IDLE_AFTER_S,
) -> list[Session]:
    """The sessions to swap out so that `requester` gets `needed_mib` more device memory.

    Empty when nothing is needed, or when even all candidates together would not free enough
    (the allocation then fails as it would without oversubscription).
    """
    if needed_mib <= 0:
        return []
    chosen: list[Session] = []
    freed = 0
    for session in candidates(sessions, requester, now_s, idle_after_s):
        chosen.append(session)
        freed += session.held_mib
        if freed >= needed_mib:
            return chosen
    return []
