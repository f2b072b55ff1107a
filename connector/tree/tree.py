"""Hybrid radix tree: which prefix of a request can be served, from which tier, and what to evict.

Keys are vLLM block hashes. vLLM chains them (hash ``i`` covers blocks ``0..i`` plus the
cache salt / LoRA extra keys), so two runs of blocks that agree on their last hash agree on
every hash: the tree compares one hash per node and binary-searches only on divergence.
Requests are also partitioned (one root per ``partition``).

A hit needs both halves of a hybrid model's cache: KV for every block up to a boundary *and*
the Mamba state at exactly that boundary. Nodes end at every boundary that has (or had) a
state, and tiers are kept per block inside a node (``node.py``).

Invariants, each kept by one piece of code and all recomputed by ``invariants.check_invariants``
after any public call:

* **P** (liveness is prefix-closed): for every unheld node, every block with a tier and the
  state at its end have every earlier block of their path in some tier (GPU, host, pending
  store or storage). Kept by ``maintenance.Maintenance`` (cascade on the first lost tier,
  revalidation of held nodes at release). Host eviction goes one block at a time from the
  end of the LRU host leaf, so losing a block's last tier kills only what lies after it: the
  conversation's earlier blocks, and every state whose prefix is still whole, stay. A store
  from the GPU marks its prefix as GPU-resident (the request really has those blocks in its
  block table), which is how "block i stored while blocks < i are on GPU only" keeps P.
* **Locks**: a load's ``LockHandle`` and a prefetch's pin kv-lock a whole path (what it locked
  is recorded in the handle, never re-derived, sgl-project/sglang#27147); a kv-locked node is in no eviction
  order and no cascade or trim touches it, so its host KV keeps its slots until ``unlock``.
  A store run holds its own request's path the same way for the length of the call.
* **Conservation**: both slot allocators belong to the tree; free + quarantined + used =
  capacity. A written-back victim's slot is quarantined until ``seal_plan``: the worker reads
  it during the step plan being built, so no store of that plan may be given it.
* **B** (the node budget, ``max_nodes``): after every public call the node count is within
  budget or no node is a metadata leaf; nodes that hold only GPU / storage marks would
  otherwise grow without bound (vLLM tells a connector nothing when it drops GPU blocks).
  Kept by ``Maintenance.trim``; it never drops host bytes, pending stores or held paths.

Where the rest lives: ``forest.py`` (shape: paths, splits, pending maps), ``eviction.py``
(victim order), ``host_eviction.py`` (freeing host slots), ``reservations.py`` (stores:
reserve, commit, roll back), ``maintenance.py`` (P and B), ``slot_allocator.py`` (host slot
indices, quarantine, free journal), ``tier_marks.py`` (GPU / storage bits of a path),
``locks.py`` (load locks and prefetch pins), ``lookups.py`` (the match walk, junction depth,
popular objects).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Protocol

from .counters import TreeCounters
from .eviction import EvictionPolicy
from .forest import Forest
from .host_eviction import HostEviction, WriteBack
from .locks import PathLocks
from .lookups import hot_objects as popular_objects
from .lookups import known_depth, longest_hit
from .maintenance import Maintenance
from .node import GPU, HOST, STORAGE, Node
from .reservations import Reservations
from .results import HotObject, LockHandle, MatchResult, StoreCursor
from .slot_allocator import SlotAllocator
from .tier_marks import clear_path, mark_path


class HostObserver(Protocol):
    """Told whenever host bytes enter or leave the CPU tier: a KV block (``host_kv``) or a
    Mamba state (``host_state``), by key hash (a state's is its node's last block hash).
    Entering is a committed store or fetch; leaving is any freed host slot (eviction, the
    cascade, a replaced state, reset). KV-cache events for routers are built from this."""

    def host_kv(self, entered: bool, block_hash: bytes) -> None: ...

    def host_state(self, entered: bool, block_hash: bytes) -> None: ...


class HybridRadixTree:
    """Tiered prefix index for hybrid (attention + Mamba) models. Owns both host allocators.

    ``max_nodes`` bounds the tree's metadata (invariant B); None leaves it unbounded. Size
    it well above the nodes one request can create (one per stored state boundary): a
    budget is enforced at the end of every mutating call, so a storage-only path that a
    prefetch will reserve slots for must be pinned first, or a trim between two
    reservations may drop its deeper, still metadata-only nodes."""

    def __init__(
        self, host_kv_capacity: int, host_mamba_capacity: int, max_nodes: int | None = None
    ) -> None:
        if max_nodes is not None and max_nodes < 1:
            raise ValueError("max_nodes must be >= 1 (or None for no budget)")
        self.kv_slots = SlotAllocator(host_kv_capacity)
        self.mamba_slots = SlotAllocator(host_mamba_capacity)
        self.max_nodes = max_nodes
        self.forest = Forest()
        self.policy = EvictionPolicy(track_trim=max_nodes is not None)
        self.counters = TreeCounters()
        self.maint = Maintenance(
            self.forest, self.kv_slots, self.mamba_slots, self.policy, self.counters
        )
        self.evictor = HostEviction(
            self.kv_slots, self.mamba_slots, self.policy, self.maint, self.counters
        )
        self.stores = Reservations(
            self.forest,
            self.kv_slots,
            self.mamba_slots,
            self.policy,
            self.maint,
            self.evictor,
            self.counters,
        )
        self.locks = PathLocks(self.forest, self.policy, self.maint)
        self.observer: HostObserver | None = None

    def set_observer(self, observer: HostObserver | None) -> None:
        """Report host-tier arrivals and departures to ``observer`` (None: nobody, no cost)."""
        self.observer = observer
        self.maint.observer = observer
        self.evictor.observer = observer
        self.stores.observer = observer

    # ------------------------------------------------------------------ step plans, frees
    def seal_plan(self) -> None:
        """The step plan being built is sealed: the slots quarantined while building it (the
        write-back victims its worker reads) become allocatable for the next plan."""
        self.kv_slots.release_quarantine()
        self.mamba_slots.release_quarantine()

    @property
    def journal_frees(self) -> bool:
        """Whether every host slot the tree frees or quarantines is journaled for
        ``take_freed`` (off by default: then a free costs one test more)."""
        return self.kv_slots.journal is not None

    @journal_frees.setter
    def journal_frees(self, on: bool) -> None:
        for alloc in (self.kv_slots, self.mamba_slots):
            if not on:
                alloc.journal = None
            elif alloc.journal is None:
                alloc.journal = []

    def take_freed(self) -> tuple[list[int], list[int]]:
        """Drain the journal: (KV slots, Mamba slots) freed or quarantined since the last
        call, in order, whatever freed them; both empty while ``journal_frees`` is off."""
        kv, mamba = self.kv_slots.journal, self.mamba_slots.journal
        if kv is None or mamba is None:
            return [], []
        self.kv_slots.journal, self.mamba_slots.journal = [], []
        return kv, mamba

    @property
    def write_back(self) -> WriteBack | None:
        """Asked before LRU eviction frees host bytes storage lacks (see ``WriteBack``)."""
        return self.evictor.write_back

    @write_back.setter
    def write_back(self, hook: WriteBack | None) -> None:
        self.evictor.write_back = hook

    @property
    def num_nodes(self) -> int:
        return self.forest.num_nodes

    # ------------------------------------------------------------------ lookups
    def match(
        self,
        hashes: Sequence[bytes],
        partition: Hashable = None,
        start_block: int = 0,
        max_blocks: int | None = None,
    ) -> MatchResult:
        """Deepest ``n`` in ``(start_block, max_blocks]`` with every block of
        ``[start_block, n)`` loadable (host or storage) and a host/storage Mamba state at
        exactly ``n``. Blocks below ``start_block`` are vLLM's own GPU hit: only their keys
        must be in the tree. Refreshes the KV LRU of the hit path and the Mamba LRU of the
        consumed state only."""
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        return longest_hit(
            self.forest, self.policy, self.counters, hashes, partition, start_block, limit
        )

    def depth(self, hashes: Sequence[bytes], partition: Hashable) -> int:
        """How many leading blocks of ``hashes`` the tree knows, in any tier or none: the
        point where this request leaves every path seen before (its junction)."""
        return known_depth(self.forest, hashes, partition)

    def hot_objects(self, result: MatchResult, threshold: int) -> list[HotObject]:
        """Host objects of a locked host hit that loads used at least ``threshold`` times and
        storage does not hold, now marked as in storage (``lookups.hot_objects``)."""
        return popular_objects(result, threshold)

    # ------------------------------------------------------------------ loads and pins
    def lock(
        self, result: MatchResult, host_only: bool = False, count_hit: bool = True
    ) -> LockHandle | None:
        """Protect exactly what the load of ``result`` reads; None if the result went stale
        (``locks.PathLocks.lock``, which says what ``host_only`` and ``count_hit`` mean)."""
        return self.locks.lock(result, host_only, count_hit)

    def pin(self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int) -> LockHandle:
        """Keep blocks ``[0, num_blocks)`` where they are while a prefetch fills the rest
        (``locks.PathLocks.pin``); release with ``unlock``."""
        return self.locks.pin(hashes, partition, num_blocks)

    @property
    def handles(self) -> set[LockHandle]:
        """The live lock handles (loads and pins)."""
        return self.locks.handles

    def unlock(self, handle: LockHandle) -> None:
        """Release exactly what ``handle`` locked (load finished or aborted, pin dropped)."""
        self.locks.unlock(handle)
        self._finish()

    # ------------------------------------------------------------------ stores
    def reserve_kv(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        block_index: int,
        from_device: bool = True,
    ) -> int | None:
        """A host slot to store block ``block_index`` into, or None (already on host or in
        flight, or no evictable space). ``from_device``: the request holds blocks
        ``0..block_index`` on GPU now, so they are marked GPU where the tree knew no tier."""
        slot = self.stores.reserve_kv(hashes, partition, block_index, from_device)
        self._finish()
        return slot

    def reserve_kv_run(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        start: int,
        end: int,
        commit_settles: bool = False,
        cursor: StoreCursor | None = None,
    ) -> list[tuple[int, int]]:
        """Host slots for the blocks of ``[start, end)`` a request just computed, in one walk:
        ``(block index, slot)`` for each block not already on host or in flight, in order,
        stopping at the first block no slot can be found for. The request holds blocks
        ``[0, end)`` on GPU, so they are all marked GPU first: an eviction that the
        allocations below cause can then never cut a hole into this path. That path is held
        for the call: the victims are other paths' blocks, never this request's own.

        ``commit_settles``: the caller ends every returned slot with ``complete_store``
        before the tree is used for anything but more reservations of the same plan (the
        scheduler's step plan does). The request's path is then put back into the LRUs once,
        by that commit, instead of once here and again there.

        ``cursor``: the same request's cursor from its previous store (``StoreCursor``); the
        walk starts at its node when that still ends at ``start``, and it is moved to the
        node holding block ``end - 1``."""
        out = self.stores.reserve_kv_run(hashes, partition, start, end, commit_settles, cursor)
        self._finish()
        return out

    def reserve_mamba(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        num_blocks: int,
        from_device: bool = True,
        cursor: StoreCursor | None = None,
    ) -> int | None:
        """A host slot for the Mamba state at boundary ``num_blocks``, or None. ``cursor``
        as for ``reserve_kv_run`` (a state at the end of the run just reserved needs no
        walk)."""
        slot = self.stores.reserve_mamba(hashes, partition, num_blocks, from_device, cursor)
        self._finish()
        return slot

    def complete_store(
        self, kv_slots: Iterable[int] = (), mamba_slots: Iterable[int] = (), ok: bool = True
    ) -> None:
        """Commit (``ok``) or roll back reserved slots. Unknown slots are counted, ignored."""
        self.stores.complete(kv_slots, mamba_slots, ok)
        self._finish()

    # ------------------------------------------------------------------ eviction
    def drop_state(self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int) -> bool:
        """Free the host Mamba state at boundary ``num_blocks`` now (a request's newer decode
        state replaces its older one); False if there is none or a load holds it."""
        found = self.forest.locate(hashes, partition, num_blocks)
        if found is None:
            return False
        x = found[0]
        if x.end != num_blocks or not x.mamba & HOST or x.mamba_lock:
            return False
        self.evictor.free_state(x, tombstone=not x.mamba & ~HOST)
        self.counters.states_replaced += 1
        self._finish()
        return True

    def reset(self) -> None:
        """Forget every tier of every block (e.g. new weights): what is not held goes now;
        held nodes are set aside (``Forest.retire``) and go when released, so in-flight loads
        and stores stay safe, nothing cached before the reset is ever served after it, and
        the same prefix stored after it grows a fresh path instead of joining theirs.

        The observer hears of the set-aside host blocks and states now (no request can reach
        them any more) and of nothing in them later: a fresh path may hold the same hashes."""
        for root in list(self.forest.roots.values()):
            for child in list(root.child_nodes()):
                if child.parent is not None:
                    self.maint.kill_from(child, 0)
        moved = self.forest.retire()
        # Held nodes of an earlier reset's subtrees are condemned already (nothing can reach
        # them to take a new hold): only the nodes set aside now join them.
        self.forest.doomed.update(x for x in moved if x.held)
        obs = self.observer
        if obs is not None:
            for x in moved:
                if x.n_host:
                    for h, f in zip(x.hashes, x.flags, strict=True):
                        if f & HOST:
                            obs.host_kv(False, h)
                if x.mamba & HOST:
                    obs.host_state(False, x.hashes[-1])
        self._finish()

    # ------------------------------------------------------------------ GPU / storage mirror
    def mark_device(
        self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int, mamba: bool = False
    ) -> None:
        """Blocks ``[0, num_blocks)`` are in vLLM's paged cache (and the state at
        ``num_blocks`` too when ``mamba``)."""
        mark_path(
            self.forest,
            self.policy,
            hashes,
            partition,
            num_blocks,
            GPU,
            (num_blocks,) if mamba else (),
        )
        self._finish()

    def mark_storage(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        num_blocks: int,
        state_ends: Iterable[int] = (),
    ) -> None:
        """Storage holds KV blocks ``[0, num_blocks)`` (a contiguous hit, as LMCache reports)
        and the Mamba state at every boundary in ``state_ends`` (each in ``1..num_blocks``).
        One walk of the path, O(num_blocks + nodes), however many states: a probe answer for
        a long conversation with a state at every block must not cost one walk per state."""
        ends = sorted(set(state_ends))
        if ends and not (1 <= ends[0] and ends[-1] <= num_blocks):
            raise ValueError(f"state_ends must lie in 1..{num_blocks}")
        mark_path(self.forest, self.policy, hashes, partition, num_blocks, STORAGE, ends)
        self._finish()

    def evict_storage(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        start_block: int = 0,
        end_block: int | None = None,
    ) -> None:
        """Storage lost blocks ``[start_block, end_block)`` (and states ending in that range)."""
        clear_path(self.forest, self.maint, hashes, partition, start_block, end_block, STORAGE)
        self._finish()

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int]:
        return {
            "host_kv_capacity": self.kv_slots.capacity,
            "host_kv_used": self.kv_slots.num_used,
            "host_kv_free": self.kv_slots.num_free,
            "host_kv_quarantined": self.kv_slots.num_quarantined,
            "host_mamba_capacity": self.mamba_slots.capacity,
            "host_mamba_used": self.mamba_slots.num_used,
            "host_mamba_free": self.mamba_slots.num_free,
            "host_mamba_quarantined": self.mamba_slots.num_quarantined,
            "nodes": self.forest.num_nodes,
            "locks": len(self.handles),
            "pins": sum(h.pinned for h in self.handles),
            "pending_stores": len(self.forest.pending_kv) + len(self.forest.pending_mamba),
            **self.counters.as_dict(),
        }

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        return self.forest.iter_nodes()

    # ------------------------------------------------------------------ internals
    def _finish(self) -> None:
        """End of every mutating call: revalidate split halves (P), then the budget (B)."""
        self.maint.flush()
        if self.max_nodes is not None and self.forest.num_nodes > self.max_nodes:
            self.maint.trim(self.max_nodes)
