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
state, one position further on. Positions live in tensors and verify shapes depend only on K,
so the CUDA-graph issue can capture the steps as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.layers import LayerKV, rope_tables
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
        self.hidden = torch.zeros(1, max_seq_len, cfg.hidden_size, device=self.device,
                                  dtype=self.dtype)  # trunk output h_t, [1, T, H]
        self.cached: list[int] = []
        self.pending = 0
        self.mtp_len = 0  # module entries are valid for positions < mtp_len
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
        return outs[0][:, -1:]

    @torch.inference_mode()
    def draft(self, k: int, sampler: Sampler) -> None:
        """Draft k tokens after the pending one into `self.drafts[:k]`."""
        self.num_drafts = k
        if k == 0:
            return
        m_count, base = self.model.num_mtp, self.length  # the pending token is x_base
        out, m = self._catch_up(), 0
        probs = []
        tok, q = sampler.pick(self.model.mtp_logits(0, out)[0, 0])
        toks = [tok]
        probs.append(q)
        for step in range(2, k + 1):
            h = self.model.chain_hidden(m, out)
            m = min(step, m_count) - 1
            p = base + step - 2 if m == 0 else base + step - 1 - m
            pos = self.positions[p:p + 1]
            out = self.model.mtp_forward(m, h, tok.view(1, 1), self._rope(pos), pos,
                                         self.mtp_kv[m], self._mask(pos, p))
            tok, q = sampler.pick(self.model.mtp_logits(m, out)[0, 0])
            toks.append(tok)
            probs.append(q)
        self.drafts[:k] = torch.stack(toks)
        self.draft_probs = None if sampler.greedy else torch.stack(probs)  # type: ignore[arg-type]

    @torch.inference_mode()
    def verify(self, sampler: Sampler) -> list[int]:
        """Verify the pending token and the current drafts; return the committed tokens."""
        k, n0 = self.num_drafts, self.length
        if n0 + k + 1 > self.max_seq_len:
            raise ContextOverflow(f"context of {self.max_seq_len} tokens is full")
        self.verify_tokens[0, 0] = self.pending
        self.verify_tokens[0, 1:k + 1] = self.drafts[:k]
        tokens = self.verify_tokens[:, :k + 1]
        pos = self.positions[n0:n0 + k + 1]
        h = self.model.trunk(tokens, self._rope(pos), pos, self.trunk_kv, self._mask(pos, n0 + k))
        self.hidden[:, n0:n0 + k + 1] = h
        logits = self.model.head(h)[0]  # [K+1, V]
        drafts = self.drafts[:k]
        if sampler.greedy:
            out, n = accept_greedy(drafts, logits)
        else:
            p = probs_from_logits(logits, sampler.temperature, sampler.top_p)
            q = self.draft_probs[:k] if k and self.draft_probs is not None else p[:0]
            out, n = accept_sampled(drafts, p, q, sampler.generator)
        accepted = int(n)  # the one host sync of a step
        new = out[:accepted + 1].tolist()
        self.cached.append(self.pending)
        self.cached.extend(new[:-1])
        self.pending = new[-1]
        self.num_drafts = 0
        return new
