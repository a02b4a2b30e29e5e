"""Runs the model over one sequence: prefill, verify and draft steps on preallocated state.

State between steps: the trunk cache holds positions 0..N-1 (`cached` are their tokens), and
`pending` is the committed token x_N not yet run through the trunk; `hidden` keeps the trunk's
output h_t for every position. MTP module m's cache holds, at each position t < `mtp_len`, the
entry made from (h_t, x_{t+1}).

A step with K drafts d_1..d_K: the trunk verifies [x_N, d_1..d_K] at positions N..N+K in one
forward; the longest agreeing prefix d_1..d_n is kept plus one token of the target's own.
Drafting then first brings every module up to the new N (the n+1 positions just verified, or
more after steps without drafts: K = 0 steps cost exactly an autoregressive step), and module
0's last row gives draft 1; drafts k >= 2 chain module min(k, M) on the previous draft's hidden
state, one position further on. `verify_many` and `draft_many` step several runners' sequences
as one batch (a runner's own steps are the one-row case). Positions live in tensors and step
shapes depend only on the batch size and K, so CUDA graphs can capture one step per pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from engine.layers import LayerKV, RowsKV, rope_tables
from engine.model import Transformer
from engine.sampling import accept_greedy, accept_sampled, probs_from_logits, sample


class ContextOverflow(ValueError):
    """The prompt plus the tokens to generate do not fit in the allocated context."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Sampler:
    """Greedy (temperature 0) or temperature/top-p sampling with its own generator."""

    def __init__(self, temperature: float, top_p: float, seed: int | None,
                 device: torch.device) -> None:
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, "
                             f"got {temperature}, {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def pick(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """Token [...] and, when sampling, the distribution it was drawn from [..., V]."""
        if self.greedy:
            return logits.argmax(-1), None
        probs = probs_from_logits(logits, self.temperature, self.top_p)
        return sample(probs, self.generator), probs


class Runner:
    """One sequence's caches and static buffers, and the prefill, draft and verify steps."""

    def __init__(self, model: Transformer, max_seq_len: int, k_max: int,
                 kv_block: int = 64) -> None:
        cfg = model.cfg
        p = model.model.embed_tokens.weight
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.max_seq_len, self.k_max = max_seq_len, k_max if model.num_mtp else 0
        self.kv_block = kv_block  # eager: attend over a multiple of this, not the whole cache

        def layers(n: int) -> list[LayerKV]:
            return [LayerKV(1, cfg.num_kv_heads, max_seq_len, cfg.head_dim, self.device,
                            self.dtype) for _ in range(n)]

        self.trunk_kv = layers(cfg.num_layers)
        self.mtp_kv = [layers(cfg.mtp_layers_per_module) for _ in range(model.num_mtp)]
        self.rope = rope_tables(cfg, max_seq_len, self.device, self.dtype)
        self.positions = torch.arange(max_seq_len, device=self.device)
        self.verify_tokens = torch.zeros(1, self.k_max + 1, dtype=torch.long, device=self.device)
        self.drafts = torch.zeros(max(self.k_max, 1), dtype=torch.long, device=self.device)
        self.draft_probs: Tensor | None = None  # [K, V] when sampling
        self.draft_confidence: list[float] = []  # each draft's probability, when asked for
        self.hidden = torch.zeros(1, max_seq_len, cfg.hidden_size, device=self.device,
                                  dtype=self.dtype)  # trunk output h_t, [1, T, H]
        self.cached: list[int] = []
        self.pending = 0
        self.mtp_len = 0  # module entries are valid for positions < mtp_len
        self._out0: tuple[int, int, Tensor] | None = None  # (length, pending, module 0 at N-1)
        self.num_drafts = 0
        self.owner: object | None = None  # the generation whose sequence this state is

    @property
    def length(self) -> int:
        return len(self.cached)

    def _mask(self, pos: Tensor, last: int) -> Tensor:
        kv_len = min(self.max_seq_len, -(-(last + 1) // self.kv_block) * self.kv_block)
        return self.positions[None, :kv_len] <= pos[:, None]  # [S, kv_len]

    def _rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        return self.rope[0][pos], self.rope[1][pos]

    def reset(self) -> None:
        self.cached, self.mtp_len, self.num_drafts, self.owner = [], 0, 0, None

    @torch.inference_mode()
    def sync(self, tokens: list[int], chunk: int = 512) -> int:
        """Make the trunk cache hold exactly `tokens`, reusing the longest common prefix with
        what it holds. Returns how many positions were reused."""
        n = len(tokens)
        if n == 0:
            raise ValueError("empty prompt")
        if n + self.k_max + 2 > self.max_seq_len:
            raise ContextOverflow(f"prompt of {n} tokens does not fit a context of "
                                  f"{self.max_seq_len} (with {self.k_max + 2} spare)")
        # Module entry t depends on x_{t+1}, so c reusable trunk positions leave c - 1 reusable
        # module entries; the trunk restarts there too (and always runs the last token).
        start = max(0, min(common_prefix(self.cached, tokens), n) - 1)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        for s in range(start, n, chunk):
            e = min(s + chunk, n)
            pos = self.positions[s:e]
            self.hidden[:, s:e] = self.model.trunk(ids[:, s:e], self._rope(pos), pos,
                                                   self.trunk_kv, self._mask(pos, e - 1))
        self.cached = list(tokens)
        self.mtp_len, self.num_drafts = min(self.mtp_len, start), 0
        return start

    def prefill(self, prompt: list[int], sampler: Sampler,
                allowed: Tensor | None = None) -> tuple[int, int]:
        """Run the prompt (reusing the cached common prefix). Returns (first token, reused).
        `allowed` [V] restricts the first token (token healing)."""
        reused = self.sync(prompt)
        with torch.inference_mode():
            logits = self.model.head(self.hidden[:, len(prompt) - 1])
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            first, _ = sampler.pick(logits)
        self.pending = int(first)
        return self.pending, reused

    def restore(self, tokens: list[int], pending: int) -> int:
        """Return to a sequence another one interrupted: `tokens` run, `pending` next."""
        reused = self.sync(tokens)
        self.pending = pending
        return reused

    @torch.inference_mode()
    def catch_up(self) -> None:
        """Bring the modules up to the trunk now (after a prefill: prompt work, not a step's),
        keeping what the first draft needs."""
        _catch_up_many([self])

    def _caught_up(self) -> Tensor | None:
        """Module 0's output at N-1 if the modules are up to date, else None."""
        out = self._out0
        if out is None or self.mtp_len != self.length or out[:2] != (self.length, self.pending):
            return None
        return out[2]

    def _catch_up(self, chunk: int = 512) -> Tensor:
        """Bring every module's cache up to the trunk; module 0's output at N-1 [1, 1, H]."""
        n = self.length
        start = min(self.mtp_len, n - 1)  # the last entry is recomputed: it yields draft 1
        nxt = torch.tensor([[*self.cached[start + 1:], self.pending]], device=self.device)
        for s in range(start, n, chunk):
            e = min(s + chunk, n)
            pos = self.positions[s:e]
            mask = self._mask(pos, e - 1)
            outs = [self.model.mtp_forward(m, self.hidden[:, s:e], nxt[:, s - start:e - start],
                                           self._rope(pos), pos, kv, mask)
                    for m, kv in enumerate(self.mtp_kv)]
        self.mtp_len = n
        self._out0 = (n, self.pending, outs[0][:, -1:])
        return self._out0[2]

    def draft(self, k: int, sampler: Sampler) -> None:
        """Draft k tokens after the pending one into `self.drafts[:k]`."""
        draft_many([self], [k], [sampler])

    def verify(self, sampler: Sampler) -> list[int]:
        """Verify the pending token and the current drafts; return the committed tokens."""
        return verify_many([self], [sampler])[0]


# Batches: several sequences, each with its own runner, stepped in one forward per model part.
# Rows drafting fewer tokens than the batch's longest are padded; the padding writes cache
# entries past the row's length, which are overwritten before they are ever attended to
# (exactly as a rejected draft's are).

def _rows(caches: list[list[LayerKV]], masks: list[Tensor]) -> list[RowsKV]:
    """Per-layer batch views of per-row cache lists."""
    return [RowsKV([row[i] for row in caches], masks) for i in range(len(caches[0]))]


def _pick(samplers: Sequence[Sampler], logits: Tensor,
          confident: bool = False) -> tuple[Tensor, list[Tensor | None], Tensor | None]:
    """One token per row of logits [B, V] with each row's sampler; what it was drawn from;
    and, when `confident`, each token's probability [B] under its row's distribution (for
    greedy rows the softmax's top, one op more than an argmax: a draft chain asks for it at
    every draft)."""
    if all(s.greedy for s in samplers):
        if confident:
            top, tok = torch.softmax(logits.float(), -1).max(-1)
            return tok, [None] * len(samplers), top
        return logits.argmax(-1), [None] * len(samplers), None
    picks = [s.pick(row) for s, row in zip(samplers, logits, strict=True)]
    tok = torch.stack([t for t, _ in picks])
    qs = [q for _, q in picks]
    if not confident:
        return tok, qs, None
    return tok, qs, torch.stack([q[t] if q is not None else torch.softmax(row.float(), -1)[t]
                                 for q, t, row in zip(qs, tok, logits, strict=True)])


def _catch_up_many(runners: Sequence[Runner]) -> Tensor:
    """Bring every row's modules up to its trunk; module 0's last output per row [B, 1, H].

    Rows with a short way to go (the tokens of the last step) run together, padded to the
    longest; a row far behind (after a prefill) runs alone, in chunks."""
    first = runners[0]
    outs: dict[int, Tensor] = {b: out for b, r in enumerate(runners)
                               if (out := r._caught_up()) is not None}
    spans = [(min(r.mtp_len, r.length - 1), r.length) for r in runners]
    width = max((e - s for b, (s, e) in enumerate(spans)
                 if b not in outs and e - s <= first.k_max + 2), default=0)
    together = [b for b, (r, (s, e)) in enumerate(zip(runners, spans, strict=True))
                if b not in outs and e - s <= first.k_max + 2 and s + width <= r.max_seq_len]
    outs.update({b: r._catch_up() for b, r in enumerate(runners)
                 if b not in outs and b not in together})
    if together:
        rows = [runners[b] for b in together]
        starts = [spans[b][0] for b in together]
        nxt = torch.tensor([[*r.cached[s + 1:], r.pending] + [0] * (width - r.length + s)
                            for r, s in zip(rows, starts, strict=True)], device=first.device)
        pos = torch.stack([r.positions[s:s + width] for r, s in zip(rows, starts, strict=True)])
        masks = [r._mask(pos[i], s + width - 1)
                 for i, (r, s) in enumerate(zip(rows, starts, strict=True))]
        h = torch.cat([r.hidden[:, s:s + width] for r, s in zip(rows, starts, strict=True)])
        model = first.model
        per_module = [model.mtp_forward(m, h, nxt, first._rope(pos), pos,
                                        _rows([r.mtp_kv[m] for r in rows], masks))
                      for m in range(model.num_mtp)]  # every module's cache catches up
        out0 = per_module[0]
        for i, (b, r, s) in enumerate(zip(together, rows, starts, strict=True)):
            outs[b] = out0[i:i + 1, r.length - s - 1:r.length - s]
            r.mtp_len = r.length
            r._out0 = (r.length, r.pending, outs[b])
    return torch.cat([outs[b] for b in range(len(runners))])


@torch.inference_mode()
def draft_many(runners: Sequence[Runner], ks: Sequence[int], samplers: Sequence[Sampler],
               go_on: Sequence[Callable[[float], bool] | None] | None = None) -> None:
    """Draft up to ks[b] tokens after row b's pending token into its `drafts`, all rows at
    once. A row with a `go_on` rule is given each draft's probability under the module
    (recorded in `draft_confidence`) and stops when the rule says so; the rows still
    drafting go on together."""
    for r, k in zip(runners, ks, strict=True):
        r.num_drafts = k
        r.draft_confidence = []
    live = [b for b, k in enumerate(ks) if k > 0]
    if not live:
        return
    rows, samplers = [runners[b] for b in live], [samplers[b] for b in live]
    rules = [go_on[b] for b in live] if go_on else [None] * len(live)
    k_top, first = max(ks), rows[0]
    model, m_count = first.model, first.model.num_mtp
    bases = [r.length for r in rows]  # each row's pending token is x_base
    if any(base + k_top > r.max_seq_len for r, base in zip(rows, bases, strict=True)):
        raise ContextOverflow(f"context of {first.max_seq_len} tokens has no room for "
                              f"{k_top} drafts")
    out, m = _catch_up_many(rows), 0
    asks = any(rule is not None for rule in rules)
    logits = model.mtp_logits(0, out)[:, 0]
    tok, q, conf = _pick(samplers, logits, asks)
    toks, probs = [tok], [q]
    ends = [r.num_drafts for r in rows]
    k_top = _stop_rows(rows, rules, ends, conf, 1)
    step = 1
    while step < k_top:
        step += 1
        h = model.chain_hidden(m, out)
        m = min(step, m_count) - 1
        ps = [base + step - 2 if m == 0 else base + step - 1 - m for base in bases]
        pos = torch.stack([r.positions[p:p + 1] for r, p in zip(rows, ps, strict=True)])
        masks = [r._mask(pos[b], p) for b, (r, p) in enumerate(zip(rows, ps, strict=True))]
        out = model.mtp_forward(m, h, tok.view(-1, 1), first._rope(pos), pos,
                                _rows([r.mtp_kv[m] for r in rows], masks))
        logits = model.mtp_logits(m, out)[:, 0]
        tok, q, conf = _pick(samplers, logits, asks)
        toks.append(tok)
        probs.append(q)
        k_top = _stop_rows(rows, rules, ends, conf, step)
    drafted = torch.stack(toks, dim=1)  # [B, K]
    for b, (r, s) in enumerate(zip(rows, samplers, strict=True)):
        r.num_drafts = k = ends[b]
        r.drafts[:k] = drafted[b, :k]
        r.draft_probs = None if s.greedy else torch.stack(
            [qs[b] for qs in probs[:k]])  # type: ignore[misc]


def _stop_rows(rows: Sequence[Runner], rules: Sequence[Callable[[float], bool] | None],
               ends: list[int], conf: Tensor | None, made: int) -> int:
    """After each row's draft number `made`: ask the rows with a rule and still drafting
    whether to go on, given their draft's probability (`conf`, [B]), cutting `ends` where
    they stop. Returns how far the batch drafts now."""
    asking = [b for b, rule in enumerate(rules) if rule is not None and ends[b] >= made]
    if asking and conf is not None:
        values = conf.tolist()  # the one host sync of a draft position
        for b in asking:
            rows[b].draft_confidence.append(values[b])
            if ends[b] > made and not rules[b](values[b]):  # type: ignore[misc]
                ends[b] = made
    return max(ends)


@torch.inference_mode()
def verify_many(runners: Sequence[Runner], samplers: Sequence[Sampler]) -> list[list[int]]:
    """Verify each row's pending token and drafts in one trunk forward; each row's committed
    tokens."""
    first = runners[0]
    k_top = max(r.num_drafts for r in runners)
    for r in runners:
        if r.length + k_top + 1 > r.max_seq_len:
            raise ContextOverflow(f"context of {r.max_seq_len} tokens is full")
        k = r.num_drafts
        r.verify_tokens[0, 0] = r.pending
        r.verify_tokens[0, 1:k + 1] = r.drafts[:k]
        r.verify_tokens[0, k + 1:] = 0
    tokens = torch.cat([r.verify_tokens[:, :k_top + 1] for r in runners])  # [B, K+1]
    pos = torch.stack([r.positions[r.length:r.length + k_top + 1] for r in runners])
    masks = [r._mask(pos[b], r.length + k_top) for b, r in enumerate(runners)]
    h = first.model.trunk(tokens, first._rope(pos), pos, _rows([r.trunk_kv for r in runners],
                                                               masks))
    logits = first.model.head(h)  # [B, K+1, V]
    committed = []
    for b, (r, sampler) in enumerate(zip(runners, samplers, strict=True)):
        k, n0 = r.num_drafts, r.length
        r.hidden[:, n0:n0 + k_top + 1] = h[b:b + 1]
        drafts, rows = r.drafts[:k], logits[b, :k + 1]
        if sampler.greedy:
            out, n = accept_greedy(drafts, rows)
        else:
            p = probs_from_logits(rows, sampler.temperature, sampler.top_p)
            q = r.draft_probs[:k] if k and r.draft_probs is not None else p[:0]
            out, n = accept_sampled(drafts, p, q, sampler.generator)
        accepted = int(n)  # the one host sync of a row's step
        new = out[:accepted + 1].tolist()
        r.cached.append(r.pending)
        r.cached.extend(new[:-1])
        r.pending = new[-1]
        r.num_drafts = 0
        committed.append(new)
    return committed
