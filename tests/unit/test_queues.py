"""Per-model queues: `first` walks the heap best-first and returns what a full sort would."""

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
