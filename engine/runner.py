"""Runs the model over one sequence: prefill, verify and draft steps on preallocated state.

State between steps: the trunk cache holds positions 0..N-1 (`cached` are their tokens), and
`pending` is the committed token x_N not yet run through the trunk. MTP module m's cache holds,
at each position t < N, the entry made from (h_t, x_{t+1}); it is refreshed after every verify
for the positions just verified, so it stays in step with the trunk.

A step with K drafts d_1..d_K: the trunk verifies [x_N, d_1..d_K] at positions N..N+K in one
forward; the longest agreeing prefix d_1..d_n is kept plus one token of the target's own.
Then every module is run over the same K+1 positions (rows past n hold garbage that the next
writes overwrite before anything attends to them), and module 0's row n gives draft 1; drafts
k >= 2 chain module min(k, M) on the previous draft's hidden state, one position further on.
Shapes depend only on K, positions live in tensors: the CUDA-graph issue captures these as is.
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
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
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
        self.cached: list[int] = []
        self.pending = 0
        self._draft_src: Tensor | None = None  # module 0's output at position N-1, [1, 1, H]
        self.num_drafts = 0

    @property
    def length(self) -> int:
        return len(self.cached)

    def _mask(self, pos: Tensor, last: int) -> Tensor:
        kv_len = min(self.max_seq_len, -(-(last + 1) // self.kv_block) * self.kv_block)
        return self.positions[None, :kv_len] <= pos[:, None]  # [S, kv_len]

    def _rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        return self.rope[0][pos], self.rope[1][pos]

    def reset(self) -> None:
        self.cached, self._draft_src, self.num_drafts = [], None, 0

    @torch.inference_mode()
    def prefill(self, prompt: list[int], sampler: Sampler, *, use_mtp: bool,
                chunk: int = 512) -> tuple[int, int]:
        """Run the prompt (reusing the cached common prefix). Returns (first token, reused)."""
        n = len(prompt)
        if n == 0:
            raise ValueError("empty prompt")
        if n + self.k_max + 2 > self.max_seq_len:
            raise ContextOverflow(f"prompt of {n} tokens does not fit a context of "
                                  f"{self.max_seq_len} (with {self.k_max + 2} spare)")
        # Module entry t depends on x_{t+1}, so a prefix of c reusable trunk positions leaves
        # c - 1 reusable module entries; recompute both from there (and at least the last token).
        start = max(0, min(common_prefix(self.cached, prompt), n) - 1)
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        hidden = []
        for s in range(start, n, chunk):
            e = min(s + chunk, n)
            pos = self.positions[s:e]
            hidden.append(self.model.trunk(tokens[:, s:e], self._rope(pos), pos, self.trunk_kv,
                                           self._mask(pos, e - 1)))
        h = torch.cat(hidden, dim=1)  # [1, n - start, H]
        first, _ = sampler.pick(self.model.head(h[:, -1]))
        self.cached, self.pending = list(prompt), int(first)
        self._draft_src, self.num_drafts = None, 0
        if use_mtp and self.model.num_mtp:
            nxt = torch.cat([tokens[:, start + 1:], first.view(1, 1)], dim=1)
            for s in range(0, n - start, chunk):
                e = min(s + chunk, n - start)
                pos = self.positions[start + s:start + e]
                outs = self._catch_up(h[:, s:e], nxt[:, s:e], pos, start + e - 1)
            self._draft_src = outs[:, -1:]
        return self.pending, start

    def _catch_up(self, h: Tensor, nxt: Tensor, pos: Tensor, last: int) -> Tensor:
        """Write every module's entries for `pos` (ending at `last`); module 0's outputs."""
        mask = self._mask(pos, last)
        outs = [self.model.mtp_forward(m, h, nxt, self._rope(pos), pos, kv, mask)
                for m, kv in enumerate(self.mtp_kv)]
        return outs[0]

    @torch.inference_mode()
    def draft(self, k: int, sampler: Sampler) -> None:
        """Draft k tokens after the pending one into `self.drafts[:k]`."""
        self.num_drafts = k
        if k == 0:
            return
        assert self._draft_src is not None, "draft() needs module state from prefill/verify"
        m_count, base = self.model.num_mtp, self.length  # the pending token is x_base
        out, m = self._draft_src, 0
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
    def verify(self, sampler: Sampler, *, use_mtp: bool) -> list[int]:
        """Verify the pending token and the current drafts; return the committed tokens."""
        k, n0 = self.num_drafts, self.length
        if n0 + k + 1 > self.max_seq_len:
            raise ContextOverflow(f"context of {self.max_seq_len} tokens is full")
        self.verify_tokens[0, 0] = self.pending
        self.verify_tokens[0, 1:k + 1] = self.drafts[:k]
        tokens = self.verify_tokens[:, :k + 1]
        pos = self.positions[n0:n0 + k + 1]
        h = self.model.trunk(tokens, self._rope(pos), pos, self.trunk_kv, self._mask(pos, n0 + k))
        logits = self.model.head(h)[0]  # [K+1, V]
        drafts = self.drafts[:k]
        if sampler.greedy:
            out, n = accept_greedy(drafts, logits)
        else:
            p = probs_from_logits(logits, sampler.temperature, sampler.top_p)
            if k:
                assert self.draft_probs is not None
                out, n = accept_sampled(drafts, p, self.draft_probs[:k], sampler.generator)
            else:
                out, n = sample(p, sampler.generator), torch.zeros((), dtype=torch.long)
        if use_mtp and self.model.num_mtp:
            outs = self._catch_up(h, out.view(1, -1), pos, n0 + k)
            self._draft_src = outs[:, n.view(1)]  # row n: (h_{N'-1}, x_{N'})
        accepted = int(n)  # the one host sync of a step
        new = out[:accepted + 1].tolist()
        self.cached.append(self.pending)
        self.cached.extend(new[:-1])
        self.pending = new[-1]
        self.num_drafts = 0
        return new
