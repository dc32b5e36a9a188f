"""Model selection and ensembles that learn from feedback: Clipper's bandit policies, pure code.

An application (daemon/apps/application.py) has K members, models that take the same input. Its
policy keeps one weight per member and learns from rewards in [0, 1] (1: the answer was right):

- `Exp3` picks ONE member per query (Auer et al.'s adversarial bandit): member i with
  probability p_i = (1 - gamma) w_i / sum(w) + gamma / K; feedback sees only the chosen member's
  reward r, so its weight grows by exp(gamma * (r / p_i) / K) (an unbiased estimate of the reward
  of every arm). The pick is made among the members that can make the deadline (the others
  left out, the rest renormalized); the reward is still weighted by the probability it had.
- `Exp4` runs SEVERAL members and answers with their weighted combination (Clipper's ensemble):
  every member that answered gets its own reward, so each weight moves by exp(-eta * (1 - r_i))
  (exponential weights with full information over those that answered).

Both mix a small share `alpha` of the total weight back into every member after each update
(Herbster and Warmuth's fixed share; Exp3.S for the bandit): without it a member that was best
for a long time keeps its lead for as long after it degrades, and one that was bad never comes
back. Weights are kept normalized (sum 1), so they never overflow or underflow.

No I/O, no clock, no global random state: the RNG is injected (anything with `random()`), so
tests replay exact decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

PolicyName = Literal["exp3", "exp4"]
Combine = Literal["softmax", "mean", "vote"]


class Rng(Protocol):
    def random(self) -> float: ...


@dataclass(slots=True)
class PolicyState:
    """What a policy learned: persisted (daemon/apps/appdb.py) and restored at start-up."""

    weights: list[float]  # one per member, summing to 1
    updates: int = 0  # feedback items learned from

    @classmethod
    def fresh(cls, members: int) -> PolicyState:
        return cls([1.0 / members] * members)


def _normalize(w: list[float], alpha: float) -> list[float]:
    """Fixed share: every member gets `alpha / K` of the total back, then the weights sum to 1."""
    total = sum(w)
    if not math.isfinite(total) or total <= 0.0:  # cannot happen with finite rewards; never a dead state
        return [1.0 / len(w)] * len(w)
    k = len(w)
    return [(1.0 - alpha) * x / total + alpha / k for x in w]


class Exp3:
    """Selection: one member per query."""

    def __init__(self, state: PolicyState, gamma: float = 0.1, alpha: float = 0.01) -> None:
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"exp3: exploration must be in (0, 1], got {gamma}")
        self.state = state
        self.gamma = gamma
        self.alpha = alpha

    def probabilities(self) -> list[float]:
        w = self.state.weights
        k = len(w)
        total = sum(w)
        return [(1.0 - self.gamma) * x / total + self.gamma / k for x in w]

    def choose(self, rng: Rng, allowed: Sequence[int] | None = None) -> tuple[int, float]:
        """(the member, the probability it was chosen with) among `allowed` (None: all)."""
        p = self.probabilities()
        idx = list(range(len(p))) if allowed is None else list(allowed)
        if not idx:
            raise ValueError("exp3: no member to choose from")
        total = sum(p[i] for i in idx)
        u = rng.random() * total
        acc = 0.0
        for i in idx:
            acc += p[i]
            if u < acc:
                return i, p[i] / total
        return idx[-1], p[idx[-1]] / total  # u == total by rounding

    def update(self, member: int, reward: float, prob: float) -> None:
        """The chosen member's reward (in [0, 1]) for a query where it was chosen with `prob`."""
        w = list(self.state.weights)
        k = len(w)
        # exp(gamma * r / (p K)) <= exp(1 / K'): bounded, since p >= gamma / K for every member
        w[member] *= math.exp(self.gamma * (reward / max(prob, 1e-12)) / k)
        self.state.weights = _normalize(w, self.alpha)
        self.state.updates += 1


class Exp4:
    """Ensemble: several members per query, their outputs combined by weight."""

    def __init__(self, state: PolicyState, eta: float = 1.0, alpha: float = 0.01) -> None:
        if eta <= 0.0:
            raise ValueError(f"exp4: learning_rate must be > 0, got {eta}")
        self.state = state
        self.eta = eta
        self.alpha = alpha

    def mixture(self, answered: Sequence[int]) -> list[float]:
        """The weights of the members that answered, renormalized to sum 1."""
        w = self.state.weights
        total = sum(w[i] for i in answered)
        if total <= 0.0:
            return [1.0 / len(answered)] * len(answered)
        return [w[i] / total for i in answered]

    def update(self, rewards: dict[int, float]) -> None:
        """Each answering member's own reward (in [0, 1]); members not in `rewards` keep their weight
        (relative to each other) but still get their share back."""
        w = list(self.state.weights)
        for i, r in rewards.items():
            w[i] *= math.exp(-self.eta * (1.0 - r))
        self.state.weights = _normalize(w, self.alpha)
        self.state.updates += 1


# ---------------------------------------------------------------- outputs


def softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def combine(outputs: Sequence[np.ndarray], weights: Sequence[float], how: Combine) -> np.ndarray:
    """The ensemble's answer, float32 of the members' shape: the weighted mean of their outputs
    (`mean`), of their softmax probabilities (`softmax`: members whose logits have different scales
    count by their weight, not their confidence), or their weighted votes for a class (`vote`: a
    one-hot of each member's argmax)."""
    acc = np.zeros(outputs[0].shape, np.float64)
    for out, w in zip(outputs, weights, strict=True):
        if how == "softmax":
            acc += w * softmax(out)
        elif how == "vote":
            acc += w * np.eye(out.shape[-1])[out.argmax(axis=-1)]
        else:
            acc += w * out
    return acc.astype(np.float32)


def label_reward(output: np.ndarray, labels: Sequence[int]) -> float:
    """The share of a query's samples whose class (argmax of the last axis) is the true label."""
    predicted = output.reshape(len(labels), -1).argmax(axis=-1)
    return float(np.mean(predicted == np.asarray(labels)))
