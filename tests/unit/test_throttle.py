"""RenderBudget: expensive answers (metrics, statistics) within a share of the event loop."""

from __future__ import annotations

from daemon.api.throttle import RenderBudget


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_fresh_while_under_budget_then_the_last_rendering_until_the_window_turns() -> None:
    clock = Clock()
    n = 0

    def render() -> int:
        nonlocal n
        n += 1
        clock.t += 0.01  # each rendering takes 10 ms of the loop
        return n

    b = RenderBudget(render, share=0.05, window_s=1.0, max_age_s=5.0, clock=clock)
    assert [b.get() for _ in range(5)] == [1, 2, 3, 4, 5]  # 50 ms: the budget of this window
    assert [b.get() for _ in range(100)] == [5] * 100  # a flood: no more loop time spent
    assert b.rendered == 5 and b.reused == 100
    clock.t += 1.0  # the next window
    assert b.get() == 6


def test_an_occasional_reader_always_gets_a_fresh_answer() -> None:
    clock = Clock()
    calls = []

    def render() -> float:
        clock.t += 0.002
        calls.append(clock.t)
        return clock.t

    b = RenderBudget(render, clock=clock)
    seen = []
    for _ in range(30):
        seen.append(b.get())
        clock.t += 0.2  # five a second, 2 ms each: 1% of the loop
    assert len(set(seen)) == 30 and b.reused == 0


def test_a_stale_answer_is_never_older_than_max_age() -> None:
    clock = Clock()

    def render() -> float:
        clock.t += 2.0  # pathological: one rendering takes longer than the window
        return clock.t

    b = RenderBudget(render, share=0.05, window_s=10.0, max_age_s=3.0, clock=clock)
    first = b.get()
    assert b.get() == first  # over budget, and the last one is recent enough
    clock.t += 4.0
    assert b.get() != first  # too old to serve: rendered again
