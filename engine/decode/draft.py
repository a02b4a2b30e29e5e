"""Drafting: bring each row's MTP modules up to its trunk, then chain drafts.

After a verify the modules lag the trunk by the positions just verified (or more, after
steps without drafts: K = 0 steps cost exactly an autoregressive step). Catching up runs
them over those positions; module 0's output at the last one gives draft 1, and drafts
k >= 2 chain module min(k, M) on the previous draft's hidden state, one position further
on. Rows step together; a row with a stopping rule is asked after each of its drafts
whether to go on, and the rows still drafting go on together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from engine.cache.slots import ContextOverflow
from engine.decode.rows import Row, batch_kv
from engine.decode.sampling import pick_rows
from engine.model.transformer import Transformer

GoOn = Callable[[float], bool]  # given a draft's probability: whether to draft another


@torch.inference_mode()
def catch_up(model: Transformer, rows: Sequence[Row]) -> Tensor:
    """Bring every row's modules up to its trunk; module 0's last output per row [B, 1, H].

    Rows with a short way to go (the tokens of the last step) run together, padded to the
    longest; a row far behind (after a prefill) runs alone, in chunks."""
    outs: dict[int, Tensor] = {b: out for b, r in enumerate(rows)
                               if (out := r.slot.module_output()) is not None}
    spans = [(min(r.slot.mtp_len, r.slot.length - 1), r.slot.length) for r in rows]
    near = rows[0].drafts.k_max + 2  # a step's worth of positions
    width = max((e - s for b, (s, e) in enumerate(spans) if b not in outs and e - s <= near),
                default=0)
    together = [b for b, (r, (s, e)) in enumerate(zip(rows, spans, strict=True))
                if b not in outs and e - s <= near and s + width <= r.slot.max_seq_len]
    outs.update({b: _catch_up_alone(model, r) for b, r in enumerate(rows)
                 if b not in outs and b not in together})
    if together:
        outs.update(zip(together, _catch_up_together(
            model, [rows[b] for b in together], [spans[b][0] for b in together], width),
            strict=True))
    return torch.cat([outs[b] for b in range(len(rows))])


def _catch_up_alone(model: Transformer, row: Row, chunk: int = 512) -> Tensor:
    slot = row.slot
    n = slot.length
    start = min(slot.mtp_len, n - 1)  # the last entry is recomputed: it yields draft 1
    nxt = torch.tensor([row.seq[start + 1:n + 1]], device=slot.device)  # x_{t+1}
    for s in range(start, n, chunk):
        e = min(s + chunk, n)
        pos = slot.positions[s:e]
        mask = slot.mask(pos, e - 1)
        outs = [model.mtp_forward(m, slot.hidden[:, s:e], nxt[:, s - start:e - start],
                                  slot.rope(pos), pos, kv, mask)
                for m, kv in enumerate(slot.mtp_kv)]
    slot.modules_caught_up(outs[0][:, -1:])
    return outs[0][:, -1:]


def _catch_up_together(model: Transformer, rows: list[Row], starts: list[int],
                       width: int) -> list[Tensor]:
    slots = [r.slot for r in rows]
    nxt = torch.tensor([r.seq[s + 1:r.slot.length + 1] + [0] * (width - r.slot.length + s)
                        for r, s in zip(rows, starts, strict=True)], device=slots[0].device)
    pos = torch.stack([slot.positions[s:s + width] for slot, s in zip(slots, starts,
                                                                        strict=True)])
    masks = [slot.mask(pos[i], s + width - 1)
             for i, (slot, s) in enumerate(zip(slots, starts, strict=True))]
    h = torch.cat([slot.hidden[:, s:s + width] for slot, s in zip(slots, starts, strict=True)])
    per_module = [model.mtp_forward(m, h, nxt, slots[0].rope(pos), pos,
                                    batch_kv([slot.mtp_kv[m] for slot in slots], masks))
                  for m in range(model.num_mtp)]  # every module's cache catches up
    outs = []
    for i, (slot, s) in enumerate(zip(slots, starts, strict=True)):
        out = per_module[0][i:i + 1, slot.length - s - 1:slot.length - s]
        slot.modules_caught_up(out)
        outs.append(out)
    return outs


@torch.inference_mode()
def draft(model: Transformer, rows: Sequence[Row], ks: Sequence[int],
          go_on: Sequence[GoOn | None] | None = None) -> None:
    """Draft up to ks[b] tokens after row b's pending token into its drafts, all rows at
    once. A row with a `go_on` rule is given each draft's probability under the module
    (recorded in its drafts' `confidence`) and stops when the rule says so."""
    for r, k in zip(rows, ks, strict=True):
        r.drafts.count = k
        r.drafts.confidence = []
    live = [b for b, k in enumerate(ks) if k > 0]
    if not live:
        return
    rows = [rows[b] for b in live]
    rules = [go_on[b] for b in live] if go_on else [None] * len(live)
    samplers = [r.sampler for r in rows]
    k_top, m_count = max(ks), model.num_mtp
    bases = [r.slot.length for r in rows]  # each row's pending token is x_base
    if any(k_top > r.slot.room() for r in rows):
        raise ContextOverflow(f"context of {rows[0].slot.max_seq_len} tokens has no room "
                              f"for {k_top} drafts")
    out, m = catch_up(model, rows), 0
    asks = any(rule is not None for rule in rules)
    tok, q, conf = pick_rows(samplers, model.mtp_logits(0, out)[:, 0], asks)
    toks, probs = [tok], [q]
    ends = [r.drafts.count for r in rows]
    k_top = _stop_rows(rows, rules, ends, conf, 1)
    step = 1
    while step < k_top:
        step += 1
        h = model.chain_hidden(m, out)
        m = min(step, m_count) - 1
        ps = [base + step - 2 if m == 0 else base + step - 1 - m for base in bases]
        pos = torch.stack([r.slot.positions[p:p + 1] for r, p in zip(rows, ps, strict=True)])
        masks = [r.slot.mask(pos[b], p) for b, (r, p) in enumerate(zip(rows, ps, strict=True))]
        out = model.mtp_forward(m, h, tok.view(-1, 1), rows[0].slot.rope(pos), pos,
                                batch_kv([r.slot.mtp_kv[m] for r in rows], masks))
        tok, q, conf = pick_rows(samplers, model.mtp_logits(m, out)[:, 0], asks)
        toks.append(tok)
        probs.append(q)
        k_top = _stop_rows(rows, rules, ends, conf, step)
    drafted = torch.stack(toks, dim=1)  # [B, K]
    for b, r in enumerate(rows):
        r.drafts.count = k = ends[b]
        r.drafts.tokens[0, 1:k + 1] = drafted[b, :k]
        r.drafts.probs = None if r.sampler.greedy else torch.stack(
            [qs[b] for qs in probs[:k]])  # type: ignore[misc]


def _stop_rows(rows: Sequence[Row], rules: Sequence[GoOn | None], ends: list[int],
               conf: Tensor | None, made: int) -> int:
    """After each row's draft number `made`: ask the rows with a rule and still drafting
    whether to go on, given their draft's probability (`conf`, [B]), cutting `ends` where
    they stop. Returns how far the batch drafts now."""
    asking = [b for b, rule in enumerate(rules) if rule is not None and ends[b] >= made]
    if asking and conf is not None:
        values = conf.tolist()  # the one host sync of a draft position
        for b in asking:
            rows[b].drafts.confidence.append(values[b])
            if ends[b] > made and not rules[b](values[b]):  # type: ignore[misc]
                ends[b] = made
    return max(ends)
