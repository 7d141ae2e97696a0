"""The interface every storage tier implements, so the scheduler never knows which it has.

The CPU tier (``CPUOffloadManager``) is the only one today. A second tier (a local disk, a
remote store) implements the same methods with the same plain data in and out, and the
scheduler keeps working unchanged. What such a tier needs beyond the CPU tier:

- **PENDING for lookups it cannot answer now.** A remote tier's lookup is a round trip, so
  ``lookup`` starts it and answers ``Status.PENDING`` until the reply arrives; the
  scheduler asks again next step. PENDING must only mean "not known yet": the scheduler
  computes the hit twice (PENDING as HIT and as MISS) and defers only when they differ
  (L2), so a tier that answers PENDING for a key it knows is absent stalls requests.
- **Slots as its own addresses.** ``prepare_load`` and ``prepare_store`` return ints that
  only the tier's transfer path interprets (file offsets, object ids); the scheduler passes
  them through to the transfer engine and never does arithmetic on them.
- **The same atomicity and pin rules (M1).** A key being read (pinned) or written is never
  evicted; ``prepare_store`` either reserves room for every absent key or returns None and
  changes nothing. A tier that evicts in the background must still honour pins.
- **Completion as the only way to READY.** A key becomes a hit only after a successful
  ``complete_store``; a failed one leaves no trace (X1). A tier whose writes are durable
  only later must answer PENDING until then.
- **Batching hooks**, if it batches work: upstream's interface adds a per-step
  ``on_schedule_end`` and ``has_pending_work`` to keep the engine stepping; they would be
  added here, with no-op defaults, when the first tier needs them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvcore.spec.manager_model import ManagerEvent, ManagerStats, PrepareStoreResult
from kvcore.spec.types import Key, Status


class OffloadManager(ABC):
    """A storage tier holding chunks by key: states, pins, slots, eviction and events.

    Each stored key is WRITING, READY, or READY and pinned by ``n`` loads. Operating
    errors (a load of a key that is not READY, an unbalanced ``complete_load``) raise a
    ``KeyError``/``ValueError`` subclass naming the key and leave the state unchanged;
    so do bad arguments (a key that is not ``bytes`` of a key's length: ``BadKeyError``;
    keys not in a list or tuple, or a ``success`` that is not a ``bool``:
    ``ArgumentTypeError``). Pending events are bounded (the CPU tier keeps at most
    ``max_pending_events`` keys' events and counts the ones it drops in
    ``stats().events_dropped``).
    Not thread-safe: the scheduler calls a tier from one thread.

    A tier may also offer ``lookup_hashes(hashes, suffix)`` and ``touch_hashes(hashes,
    suffix)``: ``lookup_many`` and ``touch`` of the keys ``hash + suffix``, one group's
    keys given as its block hashes and the group's bytes (``make_key(b"", group)``).
    The scheduler reads and touches through them when the tier's class defines both
    (the CPU tier does), so a lookup makes no key object; any other tier gets keys.
    """

    @abstractmethod
    def lookup(self, key: Key) -> Status:
        """HIT if READY (pinned or not), PENDING if not known yet, MISS if absent.

        A pure read: it does not change recency (``touch`` does).
        """

    def lookup_many(self, keys: Sequence[Key]) -> list[Status]:
        """``lookup`` of each key, in order; a tier answers a block in one call (the
        scheduler's lookup reads keys in blocks). The default asks key by key."""
        return [self.lookup(key) for key in keys]

    @abstractmethod
    def touch(self, keys: Sequence[Key]) -> None:
        """Mark keys as used, ``keys[0]`` most recent; unknown keys are ignored.

        Separate from loads so that a hit in the GPU's own prefix cache, which loads
        nothing, still keeps the offloaded copy alive.
        """

    @abstractmethod
    def prepare_load(self, keys: Sequence[Key]) -> tuple[int, ...]:
        """Pin every key against eviction and return their slots in key order.

        Every key must be READY. Each occurrence adds one pin, released by
        ``complete_load`` with the same keys.
        """

    @abstractmethod
    def complete_load(self, keys: Sequence[Key]) -> None:
        """Release the pins a ``prepare_load`` of the same keys took."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreResult | None:
        """Reserve slots for the absent keys (they become WRITING), evicting if needed.

        Returns None, having changed nothing, when not enough keys can be evicted; never
        evicts a pinned or WRITING key or a key of this call (M1).
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        """WRITING keys become READY on success, or are removed on failure (X1).

        READY and absent keys are ignored.
        """

    @abstractmethod
    def take_events(self) -> list[ManagerEvent]:
        """Drain the stored and removed events produced since the last call."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every key; the caller has flushed or discarded every in-flight job."""

    @abstractmethod
    def stats(self) -> ManagerStats:
        """Occupancy now and cumulative counters."""

    @abstractmethod
    def slot_of(self, key: Key) -> int | None:
        """The key's slot, or None if absent (for tests and debugging)."""
