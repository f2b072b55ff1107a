"""The fetch ledger: a fetch completes only when every rank acknowledged it, however many steps
that takes; a late acknowledgement can never complete another fetch; given-up fetches are
cancelled towards the workers and their slots returned at once."""

from __future__ import annotations

from himamba.connector.protocol import (
    FetchAck,
    FetchItem,
    FetchOrder,
    HiMambaWorkerMeta,
    ObjectKind,
)
from himamba.connector.scheduler.fetch_ledger import FetchLedger, FetchOutcome
from himamba.connector.scheduler.generations import StorageGenerations


class Recorder:
    def __init__(self) -> None:
        self.settled: list[tuple[int, list[bool], FetchOutcome]] = []

    def __call__(self, order: FetchOrder, ok: list[bool], outcome: FetchOutcome) -> None:
        self.settled.append((order.fetch_id, ok, outcome))


def items(*slots: int) -> list[FetchItem]:
    return [FetchItem(ObjectKind.KV, bytes([s]) * 8, s) for s in slots]


def ledger_of(
    world_size: int, rec: Recorder, gens: StorageGenerations | None = None
) -> FetchLedger:
    gens = gens or StorageGenerations()
    return FetchLedger(world_size, rec, gens, gens.new_planner())


def test_ranks_acknowledging_in_different_steps_complete_one_fetch() -> None:
    rec = Recorder()
    ledger = ledger_of(2, rec)
    fid = ledger.open(items(3, 4), expires=100.0)
    orders, cancels = ledger.take_outbox()
    assert [o.fetch_id for o in orders] == [fid] and cancels == []
    # Step k: only rank 0 finished. vLLM merges per step, so this is all the scheduler sees.
    ledger.on_acks([FetchAck(fid, 1, 0, (True, True))])
    assert rec.settled == [] and ledger.is_open(fid)
    # Step k+1: rank 1 finished.
    ledger.on_acks([FetchAck(fid, 1, 1, (True, True))])
    assert rec.settled == [(fid, [True, True], FetchOutcome.DONE)]
    assert not ledger.is_open(fid) and len(ledger) == 0
    assert ledger.counters["fetches_acked_across_steps"] == 1


def test_an_item_failed_on_any_rank_is_failed() -> None:
    rec = Recorder()
    ledger = ledger_of(2, rec)
    fid = ledger.open(items(1, 2), expires=100.0)
    ledger.on_acks([FetchAck(fid, 1, 1, (True, False)), FetchAck(fid, 1, 0, (True, True))])
    assert rec.settled == [(fid, [True, False], FetchOutcome.DONE)]


def test_late_ack_of_a_cancelled_fetch_cannot_complete_a_later_fetch_of_the_same_slots() -> None:
    rec = Recorder()
    ledger = ledger_of(2, rec)
    old = ledger.open(items(7), expires=100.0)
    ledger.take_outbox()
    ledger.on_acks([FetchAck(old, 1, 0, (True,))])
    assert ledger.abandon(old)
    assert rec.settled == [(old, [False], FetchOutcome.ABANDONED)]
    new = ledger.open(items(7), expires=100.0)  # slot 7 reused at once
    orders, cancels = ledger.take_outbox()
    assert cancels == [old] and [o.fetch_id for o in orders] == [new]
    ledger.on_acks([FetchAck(old, 1, 1, (True,))])  # rank 1's late ack of the old fetch
    assert len(rec.settled) == 1 and ledger.is_open(new)
    assert ledger.counters["stale_acks"] == 1
    ledger.on_acks([FetchAck(new, 1, 0, (True,)), FetchAck(new, 1, 1, (True,))])
    assert rec.settled[-1] == (new, [True], FetchOutcome.DONE)


def test_a_fetch_abandoned_before_it_was_sent_needs_no_cancel() -> None:
    ledger = ledger_of(1, Recorder())
    fid = ledger.open(items(1), expires=100.0)
    ledger.abandon(fid)
    assert ledger.take_outbox() == ([], [])


def test_overdue_fetches_are_reclaimed_and_duplicate_acks_ignored() -> None:
    rec = Recorder()
    ledger = ledger_of(2, rec)
    fid = ledger.open(items(5), expires=10.0)
    ledger.take_outbox()
    ledger.on_acks([FetchAck(fid, 1, 0, (True,)), FetchAck(fid, 1, 0, (True,))])
    assert ledger.counters["duplicate_acks"] == 1 and ledger.is_open(fid)
    assert ledger.expire(9.0) == [] and ledger.expire(10.0) == [fid]
    assert rec.settled == [(fid, [False], FetchOutcome.ABANDONED)]
    assert ledger.take_outbox() == ([], [fid]) and ledger.held_slots() == 0


def test_worker_metadata_of_two_ranks_merges_without_losing_acks() -> None:
    a = HiMambaWorkerMeta([FetchAck(1, 1, 0, (True,))])
    b = HiMambaWorkerMeta([FetchAck(1, 1, 1, (False,)), FetchAck(2, 1, 1, (True,))])
    merged = a.aggregate(b)
    assert sorted((x.fetch_id, x.rank) for x in merged.fetch_acks) == [(1, 0), (1, 1), (2, 1)]


def test_fetch_ids_and_planners_never_repeat_across_planners() -> None:
    """A planner switch: the old planner's late ack (same fetch id space, same item count) can
    never settle the new planner's fetch of the same slots."""
    gens = StorageGenerations()
    old_rec, new_rec = Recorder(), Recorder()
    old = FetchLedger(1, old_rec, gens, gens.new_planner())
    first = old.open(items(3), expires=100.0)
    old.take_outbox()
    old.abandon_all()
    new = FetchLedger(1, new_rec, gens, gens.new_planner())
    second = new.open(items(3), expires=100.0)
    (order,), _ = new.take_outbox()
    assert second != first and order.generation.planner == new.planner != old.planner
    new.on_acks([FetchAck(first, old.planner, 0, (True,))])  # the old fetch's late ack
    new.on_acks([FetchAck(second, old.planner, 0, (True,))])  # even with a colliding id
    assert new_rec.settled == [] and new.is_open(second)
    assert new.counters["stale_acks"] == 2
    new.on_acks([FetchAck(second, new.planner, 0, (True,))])
    assert new_rec.settled == [(second, [True], FetchOutcome.DONE)]


def test_the_epoch_survives_planners_and_a_reset_moves_it() -> None:
    gens = StorageGenerations()
    gens.new_planner()
    gens.new_epoch()  # reset while attached
    epoch = gens.epoch
    gens.detached()
    gens.new_epoch()  # reset while detached
    assert gens.epoch not in ("", epoch)
    ledger = FetchLedger(1, Recorder(), gens, gens.new_planner())
    ledger.open(items(1), expires=100.0)
    (order,), _ = ledger.take_outbox()
    assert order.generation.epoch == gens.epoch
