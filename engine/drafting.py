"""A batch's drafts: before a step, each row's plan for the modules' chain (how many drafts,
the floor the chain rule cannot cut, whether it applies); after it, each row's drafts for
the next step from the source expected to yield most (decode/sources.py), written to the
slots' buffers with the next step's inputs; and what the step tells the K policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.slots import Slot
from engine.decode.context import ContextIndex
from engine.decode.policy import KPolicy, TextKind
from engine.decode.sources import Proposal, modules_pay, propose
from engine.decode.state import DecodeState
from engine.generation import Generation, tally

Plan = tuple[int, int, bool]  # drafts at most, the chain's floor, whether the rule applies


class Drafting:
    def __init__(self, policy: KPolicy, state: DecodeState, k_max: int) -> None:
        self.policy, self.state, self.k_max = policy, state, k_max
        self._indexes: dict[int, ContextIndex] = {}  # per slot (see decode/context.py)
        # Since load, per source: steps that verified its drafts, drafts, drafts kept.
        self.totals: dict[str, list[int]] = {}

    def limit(self, g: Generation, slot: Slot) -> int:
        """The most drafts the row's next step may verify: within what is left to generate
        and the context's room."""
        return max(0, min(self.k_max, g.tokens_left() - 1, slot.room() - 2))

    def plan(self, g: Generation, slot: Slot, rows: int, early_exit: bool) -> Plan:
        """The modules' plan for the row's next step: drafts at most, the floor the chain rule
        cannot cut, and whether it applies (adaptive K). `early_exit`: whether the chain ends
        once no row goes on (eager steps); else every draft the step asks for is made."""
        if not g.use_mtp:
            return 0, 0, False
        fixed, policy = g.params.k, self.policy
        if fixed is None:  # draft at all? then as many as the step may make
            chosen = policy.choose(g.kind, rows)
            if chosen and not policy.probing and g.use_context and not modules_pay(
                    policy, g.kind, g.sequence, self.index(slot), pending(slot), chosen,
                    self.k_max, rows):
                return 0, 0, False  # the context's drafts will do
            # Eager: up to k_max, the chain deciding where to stop. A fixed-shape step makes
            # every draft it is given room for and verifies a window of k_max + 1 whatever it
            # holds: there the policy's K is the step's, and a chain cut before it would only
            # drop drafts already paid for (tiny-qwen2 on the CPU, compiled: every adaptive
            # step cost a K=8 one, 14.6 ms against 8.4 for K=3).
            k = (self.k_max if early_exit else chosen) if chosen else 0
        else:
            k = fixed
        k = min(k, self.limit(g, slot))
        if fixed is not None or not k or not early_exit:
            return k, k, False
        return k, chosen if policy.probing else 1, True

    def set_plans(self, index: list[int], plans: list[Plan], rows: int) -> None:
        self.state.set_rows(index, plan=[[k, floor, int(adaptive)] for k, floor, adaptive in plans])
        if any(adaptive for _, _, adaptive in plans):
            accept, unit = self.policy.chain_plan(rows)
            rate = self.policy.rate * self.policy.scale  # tokens/s of the unscaled cost curve
            self.state.chain_accept.copy_(torch.tensor(accept), non_blocking=True)
            self.state.chain_limit.copy_(torch.tensor([rate * u for u in unit]), non_blocking=True)

    def choose(self, gens: Sequence[Generation], slots: Sequence[Slot], rows: int) -> None:
        """After a step (or a prefill) left the modules' drafts in the slots: each row takes
        the context's instead where they are expected to yield more; those are written to
        the slots' buffers for the next step."""
        taken: list[tuple[Generation, Slot, Proposal]] = []
        for g, s in zip(gens, slots, strict=True):
            if not g.use_context or g.finish_reason is not None:
                continue
            mtp = pending(s)
            p = propose(self.policy, g.kind, g.sequence, self.index(s), mtp, self.limit(g, s),
                        g.params.k, rows)
            if p is mtp:
                continue
            if mtp.tokens:  # the modules drafted beside the context, for nothing
                self.policy.context.modules_kept(0)
            taken.append((g, s, p))
        self._write(taken)

    def index(self, slot: Slot) -> ContextIndex:
        """The context index of the slot's sequence."""
        return self._indexes.setdefault(slot.index, ContextIndex())

    def give(self, g: Generation, slot: Slot, drafts: list[int]) -> None:
        """The caller's drafts for the row's next step, in place of any made."""
        self._write([(g, slot, Proposal(drafts[:self.limit(g, slot)], [], source="given"))])

    def _write(self, rows: list[tuple[Generation, Slot, Proposal]]) -> None:
        """Drafts made on the host, into the rows' slots and their device buffers."""
        for _, s, p in rows:
            s.set_drafts(p.tokens, [], p.source, p.bucket)
        if rows:
            self.state.set_rows(
                [s.index for _, s, _ in rows], num_drafts=[len(p.tokens) for _, _, p in rows],
                given=[True] * len(rows),
                tokens=[[g.sequence[-1], *p.tokens] + [0] * (self.k_max - len(p.tokens))
                        for g, _, p in rows])

    def observe(self, g: Generation, kind: TextKind, verified: Proposal, accepted: int) -> None:
        """What the row's step did with the drafts it verified, made in `kind` of text, for
        the K policy (adaptive rows only: a fixed K says nothing about what to choose)."""
        k, source = len(verified.tokens), verified.source
        tally(self.totals, source, k, accepted)
        if g.params.k is not None:
            return
        if source == "mtp" and g.use_mtp:
            self.policy.observe(kind, k, accepted, None, verified.confidence)
            if g.use_context:
                self.policy.context.modules_kept(accepted)
        elif source == "context" and verified.bucket is not None:
            self.policy.context.observe(kind, verified.bucket, k, accepted)

    def observe_step(self, gens: Sequence[Generation], verified: Sequence[Proposal],
                     drafts: int, seconds: float, rows: int) -> None:
        """A step of `rows` rows verified the drafts `verified` and made up to `drafts`:
        its cost informs the curve it belongs to (a step verifying the context's drafts
        while making the modules' belongs to neither)."""
        if all(g.params.k is not None for g in gens):
            return
        most = max(len(p.tokens) for p in verified)
        if not drafts:
            self.policy.observe_verify(most, seconds, rows)
        elif all(p.source == "mtp" for p in verified):
            self.policy.observe_step(most, seconds, rows)

    def report(self) -> dict[str, dict[str, float]]:
        """Per source of drafts since load: steps, drafts, drafts kept and their share."""
        return {src: {"steps": n, "drafted": d, "accepted": a,
                      "acceptance": round(a / d, 3) if d else 0.0}
                for src, (n, d, a) in sorted(self.totals.items())}


def pending(slot: Slot) -> Proposal:
    """The drafts waiting in the slot, as a proposal."""
    return Proposal(slot.drafts, slot.confidence, slot.bucket, slot.source)
