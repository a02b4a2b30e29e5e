"""The K policy: how many drafts to make, from measured acceptance and measured step cost.

With a_i the chance that draft i is accepted given that drafts < i were, a step of K drafts
yields E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j tokens and costs c(K) seconds; before drafting,
the policy picks the K with the highest E(K) / c(K) (drafting at all, then up to k_max),
and once drafts exist the chain stops where going on no longer pays. The parts, each its own
module: kinds of text (`kinds`), acceptance estimates (`acceptance`), the calibration of
draft probabilities (`calibration`), step costs (`costs`), the choice of K with its probes
(`choice`), the stopping rule (`chain`), and what is kept across restarts (`store`).
`KPolicy` puts them together and is told what each step did.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from engine.decode.policy import store
from engine.decode.policy.acceptance import Acceptance
from engine.decode.policy.calibration import Calibration
from engine.decode.policy.chain import DraftChain, Plan, chain_plan
from engine.decode.policy.choice import Probes, best_k
from engine.decode.policy.costs import StepCosts, monotone
from engine.decode.policy.kinds import TextKind, classify
from engine.decode.policy.sources import ContextPolicy

__all__ = ["DraftChain", "KPolicy", "TextKind", "classify", "monotone"]


class KPolicy:
    def __init__(self, k_max: int, costs: list[float], *, decay: float = 0.05,
                 prior: float = 0.6, prior_weight: float = 2.0, probe_every: int = 8,
                 cost_decay: float = 0.05, shape_decay: float = 0.02) -> None:
        self.k_max = k_max
        self.costs = StepCosts(k_max, costs, decay=cost_decay, shape_decay=shape_decay)
        # Steps that verify K drafts the modules did not make in them (the context's).
        self.verify = StepCosts(k_max, costs, decay=cost_decay, shape_decay=shape_decay)
        self.context = ContextPolicy(k_max)
        self.acceptance = Acceptance(k_max, decay=decay, prior=prior, prior_weight=prior_weight)
        self.calibration = Calibration(k_max, prior=prior, prior_weight=prior_weight)
        self.probes = Probes(probe_every)
        self.plan_every = 8  # observed steps between refreshes of the draft chain's tables
        self._plans: dict[int, tuple[Plan, int]] = {}  # rows -> (plan, when it was made)
        self._observed = 0
        self.rate = 1.0 / self.cost(0)  # tokens per second expected at the last best K

    # Choosing K

    def best(self, kind: TextKind, rows: int = 1) -> int:
        """argmax_K E(K) / c(K) for this kind of text in a step of `rows` rows; remembers
        that rate as the run's."""
        k, self.rate = best_k(self.acceptance.rates(kind), lambda k: self.cost(k, rows))
        return k

    def choose(self, kind: TextKind, rows: int = 1) -> int:
        """The best K, but now and then one more (`probing` says so)."""
        return self.probes.choose(self.best(kind, rows), self.k_max)

    @property
    def probing(self) -> bool:
        return self.probes.probing

    def chain(self, floor: int = 1) -> DraftChain:
        return DraftChain(self, floor)

    def chain_plan(self, rows: int = 1) -> Plan:
        """The draft chain's tables for steps of `rows` rows, refreshed every `plan_every`
        observed steps (they move slowly, and a chain is made every step), and after 1, 2,
        4 ... at first: the priors they start from are soon wrong, and a chain they cut
        short keeps the positions past it from being observed (Qwen3.5-2B's shapes at
        synthetic acceptance 0.9, 0.8, 0.7, refreshed every 8 from the start: one draft on 9
        of the first generation's 14 steps, three on all 10 of the next one's)."""
        made = self._plans.get(rows)
        if made is None or self._observed - made[1] >= min(self.plan_every, max(made[1], 1)):
            made = self._plans[rows] = (chain_plan(self.calibration, self.costs.curve(rows)),
                                        self._observed)
        return made[0]

    # What a step did

    def observe(self, kind: TextKind, k: int, accepted: int, seconds: float | None = None,
                confidences: Sequence[float] = ()) -> None:
        """A row's step verified k drafts and accepted `accepted` of them; `seconds`: what
        the step took, when it ran alone; `confidences`: the module's probability for each
        draft, if known."""
        self._observed += 1
        self.acceptance.observe(kind, k, accepted)
        self.calibration.observe(k, accepted, tuple(confidences))
        if seconds is not None:
            self.costs.observe(k, seconds)
        self.probes.observe(k, accepted)

    def observe_step(self, k: int, seconds: float, rows: int) -> None:
        """A step of `rows` rows and up to k drafts took `seconds`."""
        self.costs.observe(k, seconds, rows)

    def observe_verify(self, k: int, seconds: float, rows: int) -> None:
        """A step of `rows` rows verified up to k drafts and made none: it took `seconds`."""
        self.verify.observe(k, seconds, rows)

    def set_costs(self, costs: list[float] | Mapping[int, list[float]],
                  verify: list[float] | Mapping[int, list[float]] | None = None) -> None:
        """Measured seconds per step for each K (per number of rows): the curves to start
        from; `verify`: those of steps that make no drafts (else the same)."""
        self.costs.set(costs)
        self.verify.set(costs if verify is None else verify)
        self._plans.clear()

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Steps run inside teach it nothing: a warm-up's generations (a made-up prompt, steps
        that compile or capture) are not the model's acceptance or the machine's costs. On
        the H200 a warm-up with random weights left the policy drafting nothing: adaptive K
        on Qwen2-1.5B's shapes then made 515 tokens/s where K=4 made 783."""
        kept = copy.deepcopy(self.__dict__)
        try:
            yield
        finally:
            self.__dict__.update(kept)

    # Reading it

    def cost(self, k: int, rows: int = 1) -> float:
        return self.costs.cost(k, rows)

    def verify_cost(self, k: int, rows: int = 1) -> float:
        return self.verify.cost(k, rows)

    @property
    def scale(self) -> float:
        return self.costs.scale

    def rates(self, kind: TextKind | None = None) -> list[float]:
        return self.acceptance.rates(kind)

    def expected_tokens(self, kind: TextKind, k: int) -> float:
        return self.acceptance.expected_tokens(kind, k)

    def accept_given(self, confidence: float, position: int | None = None) -> float:
        return self.calibration.accept_given(confidence, position)

    def mean_acceptance(self, position: int | None = None) -> float:
        return self.calibration.mean_acceptance(position)

    def report(self) -> dict[str, Any]:
        """Acceptance per kind and position, and the step costs now, for `ahead status`."""
        return {"acceptance_by_position": {kind.value: [round(a, 3) for a in self.rates(kind)]
                                           for kind in TextKind},
                "step_cost_ms": {str(rows): [round(self.cost(k, rows) * 1000, 3)
                                        for k in range(self.k_max + 1)]
                                 for rows in self.costs.curves},
                "verify_cost_ms": {str(rows): [round(self.verify_cost(k, rows) * 1000, 3)
                                          for k in range(self.k_max + 1)]
                                   for rows in self.verify.curves},
                "context_acceptance_by_match": self.context.report()}

    # Across restarts

    def learned(self) -> dict[str, Any]:
        return store.learned(self.acceptance, self.calibration, self.context)

    def start_from(self, state: Mapping[str, Any]) -> None:
        store.start_from(self.acceptance, self.calibration, self.context, state)
        self._plans.clear()
