"""Tenants share the prompt budget fairly, priorities order the queue and preemption, and admission
control refuses early what cannot be served within its budget. The scheduler runs without a model:
each step 'samples' a token for every request that reached its end."""

from __future__ import annotations

from collections import Counter

from tandem.config import CacheConfig, SchedulerConfig
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.engine.step import SchedulerOutput
from tandem.engine.tenant_shares import RECENT_TENANT_ROUNDS
from tandem.policy.admission import AdmissionSettings, Load, PromptRate, check_admission
from tandem.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def make_scheduler(budget: int = 256, num_blocks: int = 2000, max_seqs: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     CacheConfig(block_size=16, enable_prefix_caching=False), num_blocks, 8192)


def request(rid: str, n: int, tenant: str | None = None, priority: int = 0, weight: float = 1.0,
            t: float = 0.0) -> Request:
    return Request(rid, [(7 * i + len(rid)) % 500 for i in range(n)], PARAMS, arrival_time=t, priority=priority,
                   tenant=tenant, tenant_weight=weight)


def step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = {s.request.request_id: [1] for s in out.scheduled
               if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens}
    scheduler.update_from_output(out, sampled)
    return out


def tokens_by_tenant(out: SchedulerOutput) -> Counter:
    counts: Counter = Counter()
    for s in out.scheduled:
        counts[s.request.tenant] += s.num_new_tokens
    return counts


def test_short_chat_is_not_queued_behind_another_tenants_flood() -> None:
    s = make_scheduler(budget=256)
    for i in range(6):
        s.add_request(request(f"a{i}", 1000, "A", t=i))
    step(s)  # A's flood is running
    s.add_request(request("b0", 40, "B", t=10))
    out = step(s)
    by_tenant = tokens_by_tenant(out)
    assert by_tenant["B"] == 40, "B's whole prompt goes into the next step"
    assert by_tenant["A"] == 128, "while B has work, A's chunks are held to its share: the step stays short"
    for _ in range(3):
        out = step(s)  # B decodes its chat; A keeps its half of the prompt budget
        assert tokens_by_tenant(out)["A"] == 128
    while "b0" in s.requests:
        step(s)
    # B between two requests (its answer sent, the next not here yet): its share stays reserved a few
    # rounds, so its next chat never finds a full-budget step of A's in front of it.
    held = [tokens_by_tenant(step(s))["A"] for _ in range(RECENT_TENANT_ROUNDS)]
    assert max(held) <= 128 + 6, held  # 128 prompt tokens, and a token for each of A's six that decode
    s.add_request(request("b1", 40, "B", t=20))
    back = tokens_by_tenant(step(s))
    assert back["B"] == 40 and back["A"] <= 128 + 6, "back within the window: no long step ahead"
    while "b1" in s.requests:
        step(s)
    for _ in range(RECENT_TENANT_ROUNDS):
        step(s)
    assert tokens_by_tenant(step(s))["A"] == 256, "alone for longer than the window, A takes the whole budget"
    wide = make_scheduler(budget=1024)
    for i in range(3):
        wide.add_request(request(f"a{i}", 3000, "A", t=i))
    step(wide)
    wide.add_request(request("b", 40, "B", t=10))
    assert tokens_by_tenant(step(wide)) == {"A": 128, "B": 40}, \
        "a big budget's half would be 512 tokens: held to contended_prefill_chunk (128) while B is here"


def test_flooding_tenants_share_by_weight() -> None:
    s = make_scheduler(budget=256)
    for i in range(40):
        s.add_request(request(f"a{i}", 600, "A", weight=3.0, t=i))
        s.add_request(request(f"b{i}", 600, "B", weight=1.0, t=i + 0.5))
    total: Counter = Counter()
    for _ in range(40):
        total += tokens_by_tenant(step(s))
    assert 2.6 < total["A"] / total["B"] < 3.4


def test_one_tenant_is_served_in_arrival_order_with_the_whole_budget() -> None:
    s = make_scheduler(budget=64)
    for i in range(3):
        s.add_request(request(f"r{i}", 100, t=i))
    steps = [[(x.request.request_id, x.num_new_tokens) for x in step(s).scheduled] for _ in range(3)]
    assert steps[0] == [("r0", 64)]
    assert steps[1] == [("r0", 36), ("r1", 28)]
    assert steps[2] == [("r0", 1), ("r1", 63)], "decodes first, then the oldest prompt"


def test_priority_orders_the_queue_within_a_tenant() -> None:
    s = make_scheduler(budget=64)
    s.add_request(request("late-urgent", 40, priority=-1, t=2))
    s.add_request(request("early", 40, priority=0, t=0))
    s.add_request(request("early-background", 40, priority=5, t=1))
    order = [x.request.request_id for x in step(s).scheduled]
    assert order[0] == "late-urgent"
    assert "early-background" not in order


def test_preemption_takes_the_lowest_priority_first() -> None:
    s = make_scheduler(budget=512, num_blocks=12, max_seqs=8)  # 192 tokens of KV
    s.add_request(request("background", 62, priority=10, t=0))  # 4 blocks each, and a 5th to finish
    s.add_request(request("normal", 62, priority=0, t=1))
    s.add_request(request("urgent", 62, priority=-5, t=2))
    step(s)
    assert len(s.running) == 3
    for _ in range(200):  # decode until the pool runs dry
        step(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions >= 1
    assert s.requests["background"].num_preemptions >= 1
    assert s.requests.get("urgent") is None or s.requests["urgent"].num_preemptions == 0


def load(**kw: int) -> Load:
    return Load(**({"in_flight": 0, "waiting": 0, "queued_tokens": 0, "tenant_waiting": 0,
                    "tenant_queued_tokens": 0} | kw))


def test_admission_rules() -> None:
    settings = AdmissionSettings("slo", max_waiting_requests=10, ttft_budget_s=1.0, max_tenant_waiting_requests=3,
                                 max_tenant_queued_tokens=2000)
    ok = check_admission(settings, 8, load(in_flight=4, waiting=1, queued_tokens=100), 1, 1, 100, 1000.0, None)
    assert ok is None
    seats = check_admission(settings, 8, load(in_flight=8), 1, 1, 10, 1000.0, None)
    assert seats is not None and "capacity" in seats.message
    assert check_admission(settings, 8, load(in_flight=0), 1, 16, 10, 1000.0, None) is None, \
        "an idle engine takes even a call larger than its seats"
    queued = load(in_flight=2, waiting=2, queued_tokens=3000, tenant_queued_tokens=3000)
    slow = check_admission(AdmissionSettings("slo", ttft_budget_s=1.0), 64, queued, 1, 1, 100, 1000.0, None)
    assert slow is not None and "budget" in slow.message and slow.retry_after_s == 3
    queued = load(in_flight=2, waiting=1, queued_tokens=900, tenant_queued_tokens=900)
    assert check_admission(AdmissionSettings("slo", ttft_budget_s=1.0), 64, queued, 1, 1, 5000, 1000.0, None) is None, \
        "its own prompt is its service time, not a wait"
    flood = load(in_flight=6, waiting=5, queued_tokens=5000, tenant_queued_tokens=4900, other_tenants_waiting=1)
    assert check_admission(settings, 64, flood, 1, 1, 50, 1000.0, None) is not None, "the flooder waits behind itself"
    chat = load(in_flight=6, waiting=5, queued_tokens=5000, tenant_queued_tokens=0, other_tenants_waiting=1)
    assert check_admission(settings, 64, chat, 1, 1, 50, 1000.0, None) is None, "another tenant gets its share"
    budget = AdmissionSettings("slo", seat_overcommit=2.0, ttft_budget_s=1.0)
    soon = load(in_flight=8, seat_free_s=[0.3, 0.5, 4.0] + [9.0] * 5)
    assert check_admission(budget, 8, soon, 1, 1, 10, 1000.0, None) is None, "a seat frees up in time"
    assert check_admission(budget, 8, load(in_flight=9, seat_free_s=soon.seat_free_s), 1, 1, 10, 1000.0, None) is None
    late = check_admission(budget, 8, load(in_flight=10, seat_free_s=soon.seat_free_s), 1, 1, 10, 1000.0, None)
    assert late is not None and "frees up" in late.message and late.retry_after_s == 4
    tenant = check_admission(settings, 64, load(in_flight=3, waiting=3, tenant_waiting=3), 1, 1, 10, 1e6, None)
    assert tenant is not None and "your requests" in tenant.message
    deadline = check_admission(AdmissionSettings("slo"), 64,
                               load(in_flight=1, waiting=1, queued_tokens=900, tenant_queued_tokens=900), 1, 1, 100,
                               1000.0, 0.5)
    assert deadline is not None and "timeout" in deadline.message


def test_prompt_rate_follows_the_engine() -> None:
    rate = PromptRate(initial=100.0, smoothing=1.0)
    rate.observe(0.0, 0)
    rate.observe(0.01, 50)  # too little busy time to say anything
    rate.observe(0.5, 1000)
    assert abs(rate.rate - 2000.0) < 1e-6
