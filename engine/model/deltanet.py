"""Gated DeltaNet (Qwen3.5's linear-attention layers): a causal depthwise convolution over the
q, k, v projections, then the gated delta rule over a recurrent state S [H, Dk, Dv]:

    S_t = a_t S_{t-1} + k_t (b_t (v_t - a_t S_{t-1}^T k_t))^T     o_t = S_t^T q_t
    a_t = exp(-exp(A_log) softplus(alpha_t + dt_bias)),   b_t = sigmoid(beta_t)

with q, k L2-normalised (q also by 1/sqrt(Dk)); the output goes through an RMSNorm gated by
silu(z) and out_proj. Each group of Hv / Hk value heads shares one key head.

Three forms: `chunked` (prefill and cache-free passes: the delta rule solved per chunk of 64
positions with a triangular solve, the state carried between chunks); `recurrent` (the verify
pass: one position after another, keeping the state after each, so that the step can commit
the state at the accepted length by a pick). The verify runs the recurrent form rather than
the chunked one: position t's state is then computed from position t-1's by the same
elementwise operations however many positions share the pass, which is what keeps
speculative output bit-identical to plain decoding. The state is kept in fp32. The gates'
exp, softplus and sigmoid run on small tensors (a few values per position) through
`same_path`, so that a value's bits do not depend on where it sits in the pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import native
from engine.cache.kv import CacheBatch
from engine.cache.state import StateCache
from engine.model.config import ModelConfig
from engine.model.layers import Dense, fuse_linears, same_path

CHUNK = 64


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * silu(z), per value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    FUSED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # one matmul once fused

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_k_heads, cfg.linear_num_v_heads
        self.k_dim, self.v_dim = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_size = 2 * self.key_size + self.value_size
        self.kernel = cfg.linear_conv_kernel
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_size, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_size, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_size, self.conv_size, self.kernel, bias=False,
                                groups=self.conv_size)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_size, cfg.hidden_size, bias=False)
        self.fused: Dense | None = None
        # fp32 conv weights, A_log, dt_bias and norm weight, for the step's kernels
        self.step_params: tuple[Tensor, ...] = ()

    def fuse(self, weights: bool = True) -> None:
        """The four input projections as one matmul (see `fuse_linears`); the convolution's
        weights (by tap, [K, C]) and the gates' parameters in fp32 for the decode kernel
        (native/gdn.c)."""
        self.fused = fuse_linears(*(getattr(self, name) for name in self.FUSED),
                                  weights=weights)
        self.step_params = tuple(t.detach().float().contiguous() for t in (
            self.conv1d.weight[:, 0].t(), self.A_log, self.dt_bias, self.norm.weight))

    def forward(self, x: Tensor, batch: CacheBatch | None = None,
                cache: StateCache | None = None) -> Tensor:
        bsz, seqlen, _ = x.shape
        if self.fused is not None and cache is not None and batch is not None and \
                batch.per_position and x.device.type == "cpu" and native.available():
            out = self._step_native(self.fused(x), batch, cache)
            if out is not None:
                return out
        if self.fused is None:
            qkv, z, b, a = (p(x) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                           self.in_proj_a))
        else:
            qkv, z, b, a = self.fused(x).split(
                [self.conv_size, self.value_size, self.num_v_heads, self.num_v_heads], dim=-1)
        if cache is None:
            conv_state = x.new_zeros(bsz, self.conv_size, self.kernel - 1)
        else:
            assert batch is not None
            conv_state = cache.read_conv(batch.slots)
        window = torch.cat([conv_state, qkv.transpose(1, 2)], dim=-1)  # [B, C, K-1+S]
        mixed = causal_conv(window, self.conv1d.weight[:, 0]).to(x.dtype)  # [B, S, C]
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.reshape(bsz, seqlen, self.num_k_heads, self.k_dim)
        k = k.reshape(bsz, seqlen, self.num_k_heads, self.k_dim)
        v = v.reshape(bsz, seqlen, self.num_v_heads, self.v_dim)
        beta = same_path(torch.sigmoid, b.float())  # [B, S, Hv]
        g = -self.A_log.float().exp() * same_path(F.softplus, a.float() + self.dt_bias.float())
        q, k, v = _prepare(q, k, v, self.num_v_heads // self.num_k_heads)
        if cache is not None and batch is not None and batch.per_position:
            # the conv state after position t: the K-1 inputs up to t
            convs = window.unfold(-1, self.kernel - 1, 1)[:, :, 1:]  # [B, C, S, K-1]
            out = _recurrent_in_cache(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), cache,
                                      batch.slots)
            if out is None:
                out, states = recurrent(q, k, v, g.transpose(1, 2), beta.transpose(1, 2),
                                        cache.read_state(batch.slots))
                cache.write(batch.slots, convs.transpose(1, 2), states)
            else:
                cache.write_conv(batch.slots, convs.transpose(1, 2))
        else:
            if cache is None or batch is None:
                state = x.new_zeros(bsz, self.num_v_heads, self.k_dim, self.v_dim,
                                    dtype=torch.float32)
            else:
                state = cache.read_state(batch.slots)
            out, state = chunked(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), state)
            if cache is not None and batch is not None:
                cache.write(batch.slots, window[:, None, :, -(self.kernel - 1):], state[:, None])
        out = out.transpose(1, 2).to(x.dtype)  # [B, S, Hv, Dv]
        y = self.norm(out, z.view(bsz, seqlen, self.num_v_heads, self.v_dim))
        return self.out_proj(y.reshape(bsz, seqlen, self.value_size))


    def _step_native(self, proj: Tensor, batch: CacheBatch, cache: StateCache) -> Tensor | None:
        """The layer over a step's positions by our kernels: gdn.c from the projections to
        the delta rule's inputs (conv states written), the delta rule in the cache's ring,
        gdn.c's gated norm; None where they do not take these tensors."""
        bsz, seqlen, _ = proj.shape
        shape = (self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim, self.kernel)
        prepared = native.gdn_prepare(proj, shape, cache.conv, cache.index, batch.slots,
                                      *self.step_params[:3])
        if prepared is None:
            return None
        q, k, v, decay, beta = prepared
        cache.unsettled = None  # this pass writes the ring entries after the committed one
        pending = cache.take(batch.slots)  # the committed states a commit left unwritten
        out: Tensor | None
        if seqlen > 1:  # a verify window: no state written, the commit's deferred
            out = cache.delta_rule_window(q, k, v, decay, beta, batch.slots, pending)
        else:
            src, dst = cache.kernel_offsets(batch.slots, seqlen)
            out = native.delta_rule(q, k, v, decay, beta, cache.state, src, dst,
                                    pending=pending)
        assert out is not None or pending is None  # (the kernel took the pass that made it)
        if out is None:
            return None
        y = native.gdn_gated_norm(out, proj, self.conv_size, self.step_params[3], self.norm.eps)
        return self.out_proj(y.view(bsz, seqlen, self.value_size))


def causal_conv(window: Tensor, weight: Tensor) -> Tensor:
    """silu of the depthwise causal convolution: window [B, C, K-1+S] (the K-1 inputs before
    the S new ones first), weight [C, K]; out [B, S, C]. Written as a sum over the K taps in
    fp32 so that each position's value is computed the same way whatever S is: tap by tap
    in order over the whole window (the bits a sum over an unfolded [B, C, S, K] gave, in a
    quarter of the time: Qwen3.5-2B's 6,144 channels over 128 positions 27.8 -> 7.2 ms)."""
    kernel = weight.shape[-1]
    seqlen = window.shape[-1] - kernel + 1
    x, w = window.float(), weight.float()
    acc = x[..., :seqlen] * w[:, :1]
    for j in range(1, kernel):
        acc = acc + x[..., j:j + seqlen] * w[:, j:j + 1]
    return F.silu(acc).transpose(1, 2)


def _prepare(q: Tensor, k: Tensor, v: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """[B, S, H, D] -> [B, Hv, S, D] in fp32; q, k L2-normalised, q scaled by 1/sqrt(Dk);
    each key head repeated for its group of value heads."""
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return tuple(t.float().transpose(1, 2) for t in (q, k, v))  # type: ignore[return-value]


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _recurrent_in_cache(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        cache: StateCache, slots: Tensor) -> Tensor | None:
    """`recurrent` by our kernel where it runs (AVX-512 CPUs), its states read from and
    written into the cache's ring in place; None elsewhere."""
    cache.settle_pending(slots)
    if q.device.type != "cpu" or not native.available():
        return None
    src, dst = cache.kernel_offsets(slots, q.shape[2])
    return native.delta_rule(q, k, v, same_path(torch.exp, g), beta, cache.state,
                                       src, dst)


def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              state: Tensor) -> tuple[Tensor, Tensor]:
    """The delta rule one position at a time: q, k [B, H, S, Dk], v [B, H, S, Dv], g, beta
    [B, H, S], state [B, H, Dk, Dv]. Returns o [B, H, S, Dv] and the state after each
    position [B, S, H, Dk, Dv]."""
    outs, states = [], []
    decay = same_path(torch.exp, g)  # a_t
    for t in range(q.shape[2]):
        k_t = k[:, :, t, :, None]  # [B, H, Dk, 1]
        state = state * decay[:, :, t, None, None]
        delta = (v[:, :, t] - (state * k_t).sum(-2)) * beta[:, :, t, None]  # [B, H, Dv]
        state = state + k_t * delta[:, :, None]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
        states.append(state)
    return torch.stack(outs, dim=2), torch.stack(states, dim=1)


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            state: Tensor, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The delta rule a chunk of positions at a time (same shapes as `recurrent`); returns o
    and the final state [B, H, Dk, Dv]. Within a chunk, with G_t the decay from its start
    and U the values actually written (u_t = b_t (v_t - (a_t S_{t-1})^T k_t)):
        (I + L) U = b V - diag(b G) K S_0,   L_tj = b_t (k_t . k_j) G_t / G_j  (j < t)
        O = diag(G) Q S_0 + (Q K^T * G_t / G_j, j <= t) U
        S_C = G_C S_0 + (K * G_C / G_j)^T U"""
    seqlen = q.shape[2]
    pad = -seqlen % chunk
    if pad:  # padded positions write nothing (b = 0) and keep the state (g = 0)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    outs = []
    for s in range(0, q.shape[2], chunk):
        qc, kc, vc = q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk]
        bc = beta[:, :, s:s + chunk, None]  # [B, H, C, 1]
        cum = g[:, :, s:s + chunk].cumsum(-1)  # log G_t, [B, H, C]
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, -torch.inf).exp()
        system = ((kc * bc) @ kc.transpose(-1, -2) * decay).tril(-1)  # L [B, H, C, C]
        eye = torch.eye(chunk, device=q.device)
        rhs = torch.cat([vc * bc, kc * bc * cum[..., None].exp()], dim=-1)
        solved = torch.linalg.solve_triangular(system + eye, rhs, upper=False,
                                               unitriangular=True)
        u = solved[..., :vc.shape[-1]] - solved[..., vc.shape[-1]:] @ state  # U [B, H, C, Dv]
        attn = (qc @ kc.transpose(-1, -2)) * decay  # [B, H, C, C]
        outs.append((qc * cum[..., None].exp()) @ state + attn @ u)
        last = cum[..., -1:]  # log G_C [B, H, 1]
        state = state * last[..., None].exp() + \
            (kc * (last - cum)[..., None].exp()).transpose(-1, -2) @ u
    return torch.cat(outs, dim=2)[:, :, :seqlen], state
