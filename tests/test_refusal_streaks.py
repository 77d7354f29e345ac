"""A tenant's flood is checked before its prompts are tokenized (policy/refusal_streaks.py): after a
streak of refusals, requests are checked as large as the smallest refused one, one in PROBE_EVERY is
still checked in full, an admitted one ends the streak, it lapses when the tenant slows down, and no
other tenant is ever checked by it."""

from __future__ import annotations

from fake_clock import Clock

from tandem.policy.refusal_streaks import MAX_TENANTS, RefusalStreaks


def flood(streaks: RefusalStreaks, tenant: str | None, sizes: list[int]) -> list[int | None]:
    """Requests of these sizes, each refused: what each was assumed to be before tokenizing (None:
    checked in full, so refused with its own size)."""
    out = []
    for n in sizes:
        assumed = streaks.assumed_tokens(tenant)
        if assumed is None:
            streaks.record(tenant, True, n)
        out.append(assumed)
    return out


def test_after_a_streak_requests_are_checked_as_the_smallest_refused_and_one_in_probe_every_in_full() -> None:
    s = RefusalStreaks(streak=8, probe_every=8, clock=Clock())
    seen = flood(s, "A", [3000, 2900, 3100, 3000, 3000, 3000, 3050, 3000] + [3000] * 24)
    assert seen[:8] == [None] * 8  # the streak builds from full checks
    assert seen[8:] == ([2900] * 7 + [None]) * 3
    assert s.refusals("A") == 8 + 3


def test_an_admitted_request_ends_the_streak_and_other_tenants_have_none() -> None:
    s = RefusalStreaks(streak=8, probe_every=4, clock=Clock())
    flood(s, "A", [3000] * 20)
    assert s.assumed_tokens("B") is None and s.refusals("B") == 0
    flood(s, None, [3000] * 50)  # requests without a tenant share no streak
    assert s.assumed_tokens(None) is None
    s.record("A", False, 20)  # a probe that was small enough was admitted
    assert [s.assumed_tokens("A") for _ in range(10)] == [None] * 10


def test_the_streak_lapses_when_the_tenant_slows_down() -> None:
    clock = Clock()
    s = RefusalStreaks(streak=8, probe_every=8, hold_s=1.0, clock=clock)
    flood(s, "A", [3000] * 9)
    assert s.assumed_tokens("A") == 3000
    clock.now += 1.5  # a request a second and a half later is checked in full
    assert s.assumed_tokens("A") is None


def test_streaks_kept_are_bounded() -> None:
    s = RefusalStreaks(streak=1, probe_every=8, clock=Clock())
    for i in range(MAX_TENANTS + 10):
        s.record(f"t{i}", True, 100)
    assert s.assumed_tokens("t0") is None and s.refusals("t0") == 0  # the oldest were dropped
    assert s.assumed_tokens(f"t{MAX_TENANTS + 9}") == 100
