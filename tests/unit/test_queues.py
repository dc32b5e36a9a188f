"""Per-model queues: `first`, `head` and `pop` return what a full sort of the live requests would,
through any mix of pushes, takes from the middle, finishes in place and pops."""

from __future__ import annotations

import random

from daemon.controller.queues import ModelQueue
from daemon.request import InferenceRequest, RequestStatus
from tests.unit.harness import make_spec


def test_first_matches_a_full_sort_of_the_live_entries() -> None:
    spec = make_spec()
    for seed in range(200):
        rng = random.Random(seed)
        for by_arrival in (False, True):
            q = ModelQueue(by_arrival)
            reqs = []
            for _ in range(rng.randint(0, 60)):
                # (deadlines and arrivals from a few values too: ties are ordered by sequence number)
                t = rng.random() if seed % 2 else rng.choice([0.25, 0.5, 0.75])
                r = InferenceRequest(spec, (), 1, t, rng.choice([t, rng.random()]), rank=rng.choice([1, 2, 10]))
                q.push(r)
                reqs.append(r)
            for r in rng.sample(reqs, len(reqs) // 3):  # some taken for a batch, some finished in place
                if rng.random() < 0.5:
                    q.take(r)
                else:
                    r.status = RequestStatus.FAILED
                    q.discard(r)
            live = [r for r in reqs if r.status == RequestStatus.QUEUED and r.queue_seq]
            key = (lambda r: (r.rank, r.arrival, r.queue_seq)) if by_arrival else \
                (lambda r: (r.rank, r.deadline, r.queue_seq))
            live.sort(key=key)
            for n in (0, 1, 3, 8, 100):
                assert q.first(n) == live[:n], (seed, by_arrival, n)
            assert list(q) == live


def test_any_sequence_of_operations_keeps_the_order_of_a_full_sort() -> None:
    """Pushes in and out of order (returned requests go back by urgency), batches taken from the
    middle (enough to make `first` drop the dead entries it passes), pops and finishes in place."""
    spec = make_spec()
    for seed in range(40):
        rng = random.Random(seed)
        by_arrival = seed % 3 == 0
        q = ModelQueue(by_arrival)
        queued: list[InferenceRequest] = []

        def order(x: InferenceRequest, by_arrival: bool = by_arrival) -> tuple[int, float, int]:
            return x.rank, x.arrival if by_arrival else x.deadline, x.queue_seq

        t = 0.0
        for _ in range(600):
            op = rng.random()
            if op < 0.5 or not queued:
                t += rng.random() * 0.01
                # mostly in deadline order (a fixed SLO), sometimes not (a client timeout, a return)
                deadline = t + (0.1 if rng.random() < 0.8 else rng.random() * 0.2)
                r = InferenceRequest(spec, (), 1, t, deadline, rank=rng.choice([1, 10, 10, 10]))
                q.push(r)
                queued.append(r)
            elif op < 0.7:  # a batch from anywhere
                for r in rng.sample(queued, min(len(queued), rng.randint(1, 8))):
                    q.take(r)
                    queued.remove(r)
            elif op < 0.8:  # finished in place (cancelled, expired)
                r = rng.choice(queued)
                r.status = RequestStatus.FAILED
                q.discard(r)
                queued.remove(r)
            elif op < 0.9:
                want = min(queued, key=order)
                assert q.head() is want
                assert q.pop() is want
                queued.remove(want)
            else:
                n = rng.randint(0, 80)
                assert q.first(n) == sorted(queued, key=order)[:n], seed
            assert len(q) == len(queued)
        want_all = sorted(queued, key=order)
        assert list(q) == want_all
        assert q.head() is (want_all[0] if want_all else None)
