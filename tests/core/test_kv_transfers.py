"""The scheduler's P/D half (core/kv_transfers.py) through the Scheduler, with a connector whose loads end as the test
says: a load that cannot be stopped and is overdue lets its request go on (recomputed, or failed) while its blocks
stay out of use until the load has ended; a request finished while loading keeps its blocks held the same way. After
every step the pools are checked, and at the end they are whole."""
from __future__ import annotations

import pytest

from pdserve.config import SchedulerConfig
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.kv_transfers import KVTransfers
from pdserve.core.scheduler import Scheduler
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.base import ConnectorContext, ConnectorMeta, FinishedTransfers, KVConnector
from tests.core.test_scheduler import check

BLOCK = 4
NUM_BLOCKS = 32


class ScriptedConnector(KVConnector):
    """Offers every remote-prefill request's prompt but its last token; reports what the test queues in `next`."""

    def __init__(self):
        super().__init__(None, ConnectorContext(BLOCK))
        self.allocated: dict[str, list[int]] = {}
        self.next = FinishedTransfers()

    def get_num_new_matched_tokens(self, req, num_local_computed):
        return req.num_prompt_tokens - 1 - num_local_computed

    def update_state_after_alloc(self, req, block_ids, num_local_computed):
        self.allocated[req.request_id] = list(block_ids)

    def build_connector_meta(self):
        return ConnectorMeta()

    def request_finished(self, req, block_ids):
        return False, None

    def start_load_kv(self, meta):
        pass

    def get_finished(self):
        out, self.next = self.next, FinishedTransfers()
        return out

    def lease_time_left(self, req):
        return 30.0


def make(policy="recompute", num_blocks=NUM_BLOCKS, max_model_len=256):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True)
    conn = ScriptedConnector()
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_model_len)
    return Scheduler(cfg, kv, max_model_len, transfers=KVTransfers(kv, conn, policy)), kv, conn


def remote(rid, n):
    """A request of n prompt tokens (k blocks + 1 for n = 4k + 1) with checked remote-prefill params."""
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0),
                   kv_transfer_params={"do_remote_prefill": True})


def step(sched, kv, conn):
    failed = sched.process_transfers(conn.get_finished())
    out = sched.schedule()
    check(sched, kv)
    sched.update_from_output(out, [7 if row.samples else None for row in out.rows])
    check(sched, kv)
    return out, failed


def test_overdue_load_recomputes_without_its_blocks_until_the_load_ends():
    sched, kv, conn = make()
    sched.add_request(remote("a", 4 * 3 + 1))
    out, _ = step(sched, kv, conn)
    assert not out.rows and "a" in sched.transfers.loading
    loaded_into = conn.allocated["a"]
    conn.next = FinishedTransfers(overdue={"a": "read overdue"})
    out, failed = step(sched, kv, conn)
    assert not failed and "a" not in sched.transfers.loading
    standin = next(k for k in kv.req_blocks if k.startswith("a#held-"))
    assert kv.blocks_of(standin) == loaded_into  # held, not free, while the read may still write them
    assert out.rows and out.rows[0].request.request_id == "a" and out.rows[0].num_computed_tokens == 0  # recomputed
    assert not set(kv.blocks_of("a")) & set(loaded_into)
    while sched.has_unfinished():
        step(sched, kv, conn)
    assert kv.blocks_of(standin) == loaded_into  # the request is done; the read is not
    conn.next = FinishedTransfers(ended={"a"})
    step(sched, kv, conn)
    assert not kv.req_blocks and not sched.transfers.deferred_free and not sched.transfers.held
    assert kv.num_free_blocks() == NUM_BLOCKS - 1  # the pool is whole


def test_overdue_load_fails_its_request_by_policy_and_holds_the_blocks():
    sched, kv, conn = make(policy="fail")
    sched.add_request(remote("a", 4 * 2))
    step(sched, kv, conn)
    loaded_into = conn.allocated["a"]
    conn.next = FinishedTransfers(overdue={"a": "read overdue"})
    _, failed = step(sched, kv, conn)
    assert [r.request_id for r in failed] == ["a"] and failed[0].status == RequestStatus.FINISHED_ERROR
    assert failed[0].error == "read overdue" and not sched.has_unfinished()
    assert sorted(b for k, v in kv.req_blocks.items() for b in v) == sorted(loaded_into)
    conn.next = FinishedTransfers(ended={"a"})
    step(sched, kv, conn)
    assert not kv.req_blocks and kv.num_free_blocks() == NUM_BLOCKS - 1


def test_request_finished_while_loading_keeps_its_blocks_until_the_overdue_load_ends():
    sched, kv, conn = make()
    sched.add_request(remote("a", 4 * 2 + 1))
    sched.add_request(remote("b", 1 + 4))
    step(sched, kv, conn)
    assert set(sched.transfers.loading) == {"a", "b"}
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert "a" in sched.transfers.deferred_free  # a loader may still write them
    conn.next = FinishedTransfers(overdue={"a": "read overdue"}, done_recving={"b"})
    step(sched, kv, conn)
    assert "a" in sched.transfers.deferred_free and "a" in kv.req_blocks  # still held under its own id
    assert not any("#held-" in k for k in kv.req_blocks)  # no stand-in: the request is gone already
    conn.next = FinishedTransfers(ended={"a"})
    while sched.has_unfinished() or conn.next.ended:
        step(sched, kv, conn)
    assert not kv.req_blocks and not sched.transfers.deferred_free and kv.num_free_blocks() == NUM_BLOCKS - 1


@pytest.mark.parametrize("n", [2, BLOCK, BLOCK + 1, 3 * BLOCK + 1, 34])  # max_model_len 37: 34 + 2 tokens fits
def test_overdue_then_recompute_at_odd_sizes_leaves_the_pool_whole(n):
    sched, kv, conn = make(num_blocks=13, max_model_len=37)
    sched.add_request(remote("a", n))
    step(sched, kv, conn)
    assert "a" in sched.transfers.loading
    conn.next = FinishedTransfers(overdue={"a": "read overdue"})
    step(sched, kv, conn)
    for _ in range(100):  # the read ends once the recompute is stuck for blocks or done, whichever comes first
        if not sched.has_unfinished() and not sched.transfers.held:
            break
        out, _ = step(sched, kv, conn)
        if not out.rows and sched.transfers.held:
            conn.next = FinishedTransfers(ended={"a"})
    assert not sched.has_unfinished() and not kv.req_blocks and kv.num_free_blocks() == 12


def test_one_token_prompt_loads_nothing_and_prefills():
    sched, kv, conn = make()
    sched.add_request(remote("a", 1))
    out, _ = step(sched, kv, conn)
    assert not sched.transfers.loading and out.rows[0].num_scheduled_tokens == 1 and "a" not in conn.allocated
    while sched.has_unfinished():
        step(sched, kv, conn)
    assert kv.num_free_blocks() == NUM_BLOCKS - 1


def test_full_pool_recompute_waits_for_the_held_blocks():
    """The pool holds one load (3 blocks: 2 of prompt, the replay's): after the read is overdue its blocks stay held,
    so the recompute cannot be admitted until the read has ended."""
    sched, kv, conn = make(num_blocks=4)
    sched.add_request(remote("a", 2 * BLOCK + 1))
    step(sched, kv, conn)
    assert kv.num_free_blocks() == 0
    conn.next = FinishedTransfers(overdue={"a": "read overdue"})
    out, _ = step(sched, kv, conn)
    assert not out.rows and list(sched.waiting) == [sched.requests["a"]]  # no block free: it waits, nothing leaks
    out, _ = step(sched, kv, conn)
    assert not out.rows
    conn.next = FinishedTransfers(ended={"a"})
    out, _ = step(sched, kv, conn)
    assert out.rows and out.rows[0].num_computed_tokens == 0
    while sched.has_unfinished():
        step(sched, kv, conn)
    assert not kv.req_blocks and kv.num_free_blocks() == 3


def test_a_gone_lease_recomputes_whatever_the_policy_and_a_failed_load_does_not():
    """P answered `expired` (LeaseGone): nothing failed, so the request is prefilled here even under policy fail;
    a load that failed beside it in the same poll fails by the policy. The pool is whole at the end."""
    sched, kv, conn = make(policy="fail")
    sched.add_request(remote("gone", 4 * 2 + 1))
    sched.add_request(remote("broken", 4 * 2))
    step(sched, kv, conn)
    assert set(sched.transfers.loading) == {"gone", "broken"}
    conn.next = FinishedTransfers(failed={"broken": "KV load failed (ProtocolError)"}, gone={"gone"})
    out, failed = step(sched, kv, conn)
    assert [r.request_id for r in failed] == ["broken"] and failed[0].status == RequestStatus.FINISHED_ERROR
    assert [(r.request.request_id, r.num_computed_tokens) for r in out.rows] == [("gone", 0)]  # prefilled here
    while sched.has_unfinished():
        step(sched, kv, conn)
    assert not kv.req_blocks and kv.num_free_blocks() == NUM_BLOCKS - 1


def test_loads_that_end_in_one_poll_are_taken_in_the_order_they_began():
    """Finished transfers come as sets; the requests they free go back in the order their loads began (not the
    sets' order, which follows Python's string hashing): the replays, and the recomputes at the queue's front."""
    ids = [f"r{i}" for i in (5, 1, 9, 3)]
    for ended in ("done_recving", "gone"):
        sched, kv, conn = make(num_blocks=64)
        for rid in ids:
            sched.add_request(remote(rid, 4 * 2))
        step(sched, kv, conn)
        assert list(sched.transfers.loading) == ids
        conn.next = FinishedTransfers(**{ended: set(reversed(ids))})
        out, _ = step(sched, kv, conn)
        assert [r.request.request_id for r in out.rows] == ids, ended
