"""The K policy: measured acceptance and cost decide K; text kinds are told apart."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from engine.decode.policy import DraftChain, KPolicy, TextKind, classify

COSTS = [1.0 + 0.1 * k for k in range(9)]  # verify cost grows slowly with K, as on a GPU


def trained(rate: float, kind: TextKind = TextKind.CODE, steps: int = 200) -> KPolicy:
    policy = KPolicy(8, COSTS, probe_every=0)
    for step in range(steps):
        # Accept each position with probability `rate`, deterministically spread out.
        accepted = 0
        while accepted < 8 and ((step * 7 + accepted * 13) % 100) < rate * 100:
            accepted += 1
        policy.observe(kind, 8, accepted)
    return policy


def test_near_zero_acceptance_picks_k0() -> None:
    assert trained(0.02).best(TextKind.CODE) == 0


def test_near_one_acceptance_picks_large_k() -> None:
    assert trained(0.99).best(TextKind.CODE) == 8


def test_expensive_drafts_lower_k() -> None:
    policy = trained(0.7)
    cheap = policy.best(TextKind.CODE)
    policy.set_costs([1.0 + 1.0 * k for k in range(9)])  # each draft as costly as a verify
    assert policy.best(TextKind.CODE) < cheap


def test_kinds_are_kept_apart() -> None:
    policy = trained(0.99, TextKind.CODE)
    for _ in range(200):
        policy.observe(TextKind.COMMENT, 8, 0)
    assert policy.best(TextKind.CODE) == 8
    assert policy.best(TextKind.COMMENT) == 0


def test_probing_keeps_measuring_past_the_best_k() -> None:
    policy = KPolicy(8, COSTS, probe_every=4)
    for _ in range(100):
        policy.observe(TextKind.CODE, 1, 0)
    chosen = [policy.choose(TextKind.CODE) for _ in range(8)]
    assert chosen.count(0) == 6 and chosen.count(1) == 2


def test_costs_are_learned_from_measured_steps() -> None:
    policy = KPolicy(2, [1.0, 2.0, 3.0])
    for _ in range(300):
        policy.observe(TextKind.CODE, 2, 2, seconds=6.0)
    # Steps of K = 2 cost twice the table: K = 2 is learned, and every K moves with it.
    assert policy.cost(2) == pytest.approx(6.0, rel=1e-3)
    assert policy.cost(0) > 1.5 and policy.cost(1) > 3.0
    policy.observe(TextKind.CODE, 2, 2, seconds=600.0)  # a hiccup moves it only a little
    assert policy.cost(2) < 7.0


def test_a_wrong_shape_of_the_cost_table_is_corrected_by_live_steps() -> None:
    policy = KPolicy(2, [1.0, 2.0, 3.0])  # measured at start-up: each draft costs the same
    for _ in range(300):  # in use, the first draft costs as much as the step, the second none
        policy.observe(TextKind.CODE, 1, 1, seconds=2.0)
        policy.observe(TextKind.CODE, 2, 2, seconds=2.0)
    assert policy.cost(1) == pytest.approx(2.0, rel=0.02)
    assert policy.cost(2) == pytest.approx(2.0, rel=0.02)


def test_bad_cost_table_is_refused() -> None:
    with pytest.raises(ValueError):
        KPolicy(2, [1.0, 0.0, 1.0])


@pytest.mark.parametrize(("tail", "kind"), [
    ("def f(x):\n    return x", TextKind.CODE),
    ("x = 1  # the count of", TextKind.COMMENT),
    ("// a C comment", TextKind.COMMENT),
    ("name = 'abc", TextKind.STRING),
    ('s = "it\\"s', TextKind.STRING),
    ('def f():\n    """Return the', TextKind.STRING),
    ('def f():\n    """Doc."""\n    return', TextKind.CODE),
    ("s = '#not a comment'", TextKind.CODE),
])
def test_classify(tail: str, kind: TextKind) -> None:
    assert classify(tail) == kind


def test_failed_probes_back_off_and_a_success_resets() -> None:
    policy = KPolicy(8, COSTS, probe_every=4)
    for _ in range(100):
        policy.observe(TextKind.CODE, 1, 0)
    probes = 0
    for _ in range(400):
        k = policy.choose(TextKind.CODE)
        probes += k > 0
        policy.observe(TextKind.CODE, k, 0)
    assert 5 <= probes <= 12  # every 4th step without backing off would be 100
    for _ in range(200):  # the drafts turn good: the first successful probe raises K
        k = policy.choose(TextKind.CODE)
        policy.observe(TextKind.CODE, k, k)
    assert policy.best(TextKind.CODE) == 8


def test_calibration_starts_at_the_probability_and_learns_the_truth() -> None:
    policy = KPolicy(8, COSTS)
    assert policy.accept_given(0.15) == pytest.approx(0.15)  # no observations yet
    for _ in range(300):  # drafts the module gives 0.15 are in truth accepted 3 times in 4
        for accepted in (0, 1, 1, 1):
            policy.observe(TextKind.CODE, 1, accepted, confidences=[0.15])
    assert policy.accept_given(0.15) == pytest.approx(0.75, abs=0.03)
    assert policy.accept_given(0.95) == pytest.approx(0.95)  # other bins are untouched


def test_calibration_is_kept_per_draft_position() -> None:
    policy = KPolicy(8, COSTS)
    for step in range(400):  # at probability 0.55, a first draft is right half the time,
        first = step % 2  # a fourth one (the three before it right) nineteen times in twenty
        fourth = int(step % 20 != 0)
        policy.observe(TextKind.CODE, 1, first, confidences=[0.55])
        policy.observe(TextKind.CODE, 4, 3 + fourth, confidences=[0.99, 0.99, 0.99, 0.55])
    assert policy.accept_given(0.55, 0) == pytest.approx(0.5, abs=0.05)
    assert policy.accept_given(0.55, 3) == pytest.approx(0.95, abs=0.05)
    assert policy.mean_acceptance(7) == pytest.approx(policy.mean_acceptance(), abs=0.01)


def test_the_chain_stops_where_no_longer_chain_pays() -> None:
    """The chain's break-even table gives the same answer as weighing every longer chain."""
    rng = random.Random(0)
    policy = trained(0.8)
    for _ in range(300):
        confidences = [rng.random() for _ in range(8)]
        accepted = next((i for i, c in enumerate(confidences) if rng.random() > c), 8)
        policy.observe(TextKind.CODE, 8, accepted, confidences=confidences)
    policy.best(TextKind.CODE)
    for _ in range(200):
        chain, survival = DraftChain(policy), 1.0
        for k in range(1, 8):
            c = rng.random()
            survival *= policy.accept_given(c, k - 1)
            ahead = [policy.mean_acceptance(i) for i in range(8)]
            gains, run, total = [], survival, 0.0
            for j in range(k + 1, 9):
                run *= ahead[j - 1]
                total += run
                gains.append(total - policy.rate * (policy.cost(j) - policy.cost(k)))
            if chain.more(c) != (max(gains) > 0):
                pytest.fail(f"draft {k}: the chain disagrees with the longer chains' gains")
            if max(gains) <= 0:
                break


def test_what_was_learned_carries_over_to_a_new_policy() -> None:
    policy = trained(0.8)
    for _ in range(50):
        policy.observe(TextKind.COMMENT, 8, 2, confidences=[0.9, 0.6, 0.3])
    fresh = KPolicy(8, COSTS)
    fresh.start_from(json.loads(json.dumps(policy.learned())))  # as saved to a file
    for kind in TextKind:
        assert fresh.rates(kind) == pytest.approx(policy.rates(kind), abs=1e-3)
    assert fresh.accept_given(0.3, 2) == pytest.approx(policy.accept_given(0.3, 2), abs=1e-3)
    shorter = KPolicy(4, COSTS[:5])  # fewer draft positions: takes those it has
    shorter.start_from(policy.learned())
    assert shorter.rates(TextKind.CODE) == pytest.approx(policy.rates(TextKind.CODE)[:4],
                                                         abs=1e-3)


def test_the_contexts_tables_carry_over_and_older_files_start_them_from_priors() -> None:
    policy = trained(0.8)
    for _ in range(30):
        policy.context.observe(TextKind.CODE, 4, 3, 3)
        policy.context.observe(TextKind.STRING, 0, 2, 0)
    saved = json.loads(json.dumps(policy.learned()))
    fresh = KPolicy(8, COSTS)
    fresh.start_from(saved)
    assert fresh.context.report() == policy.context.report()
    assert fresh.context.tables[0].rates(TextKind.STRING)[0] < 0.1
    del saved["context"]  # a file saved before context drafts
    older = KPolicy(8, COSTS)
    older.start_from(saved)
    assert older.context.report() == KPolicy(8, COSTS).context.report()
    assert older.rates(TextKind.CODE) == pytest.approx(policy.rates(TextKind.CODE), abs=1e-3)


@pytest.mark.parametrize("damage", [
    lambda s: s.update(version=2),
    lambda s: s.update(k_max=-1),
    lambda s: s["accept"].update(code=[[1.0, 0.5]] * 8),  # more accepted than observed
    lambda s: s["accept"].pop("string"),
    lambda s: s.update(calibration=s["calibration"][:3]),
    lambda s: s["calibration_at"][0].__setitem__(0, ["x", 1]),
    lambda s: s["calibration_at"][1].__setitem__(0, [float("nan"), 1.0]),
    lambda s: s.update(context=s["context"][:2]),
    lambda s: s["context"][3].update(code=[[2.0, 1.0]] * 8),
])
def test_a_damaged_state_is_refused_and_changes_nothing(damage: Any) -> None:
    state = trained(0.8).learned()
    damage(state)
    fresh = KPolicy(8, COSTS)
    before = fresh.learned()
    with pytest.raises(ValueError):
        fresh.start_from(state)
    assert fresh.learned() == before


def test_the_chain_goes_on_while_drafts_look_good_and_stops_at_a_doubtful_one() -> None:
    policy = trained(0.8)
    policy.best(TextKind.CODE)  # sets the run's rate, as choose() does each step
    sure = DraftChain(policy)
    assert all(sure.more(0.99) for _ in range(7))  # confident all the way to k_max
    doubtful = DraftChain(policy)
    assert doubtful.more(0.9) and not doubtful.more(0.02)
    probe = DraftChain(policy, floor=3)
    assert probe.more(0.01) and probe.more(0.01) and not probe.more(0.01)


def test_expensive_drafts_stop_the_chain_sooner() -> None:
    def length(costs: list[float]) -> int:
        policy = trained(0.8)
        policy.set_costs(costs)
        policy.best(TextKind.CODE)
        chain, n = DraftChain(policy), 1
        while n < 8 and chain.more(0.6):
            n += 1
        return n

    assert length([1.0 + 1.0 * k for k in range(9)]) < length(COSTS)


def test_the_device_rule_decides_as_the_chain_does() -> None:
    """`decode.draft.chain_rule` (the rule as the step runs it, all rows at once) makes the
    decisions `DraftChain.more` makes, draft after draft."""
    import torch

    from engine.decode.draft import chain_rule

    rng = random.Random(1)
    policy = trained(0.8)
    for _ in range(300):
        confidences = [rng.random() for _ in range(8)]
        accepted = next((i for i, c in enumerate(confidences) if rng.random() > c), 8)
        policy.observe(TextKind.CODE, 8, accepted, confidences=confidences)
    policy.best(TextKind.CODE)
    accept, unit = policy.chain_plan()
    rate = policy.rate * policy.scale
    accept_t = torch.tensor(accept, dtype=torch.float64)
    limit_t = torch.tensor([rate * u for u in unit], dtype=torch.float64)
    rows = 300
    confs = torch.rand(rows, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    floors = torch.tensor([rng.randint(1, 3) for _ in range(rows)])
    chains = [DraftChain(policy, floor=int(f)) for f in floors]
    survival = torch.ones(rows, dtype=torch.float64)
    alive = torch.ones(rows, dtype=torch.bool)
    for j in range(1, 8):
        survival, go_on = chain_rule(accept_t, limit_t, j, survival, confs[:, j - 1], floors,
                                     torch.ones(rows, dtype=torch.bool))
        for b in range(rows):
            if alive[b]:
                assert bool(go_on[b]) == chains[b].more(float(confs[b, j - 1])), (b, j)
        alive &= go_on
    assert 0 < int(alive.sum()) < rows  # some chains went the whole way, some stopped


def test_a_fresh_chain_learns_within_its_first_steps() -> None:
    """Drafts the module gives little probability start out valued at that probability, so
    a new policy's chain stops after its first; once a few such drafts were accepted, the
    chain goes on past it (its tables are refreshed after 1, 2, 4 ... steps at first, not
    only every `plan_every`)."""
    policy = KPolicy(4, COSTS[:5], probe_every=0)

    def length() -> int:
        policy.best(TextKind.CODE)
        chain, n = DraftChain(policy), 1
        while n < 4 and chain.more(0.02):
            n += 1
        return n

    assert length() == 1
    for _ in range(4):  # the chain stopped after one draft, and it was accepted
        policy.observe(TextKind.CODE, 1, 1, confidences=[0.02])
    assert length() > 1
