"""What the decode step keeps on the device between steps, one row per slot.

Every input of a step lives in one of these buffers, written by the host before the step
(a row of a few numbers per slot) and read by the step through the batch's slot indices:
so a step is a function of fixed-shape tensors and can be captured as a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.decode.policy.calibration import CONFIDENCE_BINS

# Columns of `plan`: drafts a row may keep, drafts it keeps whatever the chain rule says,
# whether the chain rule applies (adaptive K).
K_LIMIT, FLOOR, ADAPTIVE = 0, 1, 2


class DecodeState:
    def __init__(self, num_slots: int, k_max: int, vocab_size: int,
                 device: torch.device) -> None:
        s, k = num_slots, max(k_max, 1)
        self.k_max, self.device = k_max, device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens = zeros(s, k_max + 1)  # the pending token, then the drafts
        self.num_drafts = zeros(s)
        self.lengths = zeros(s)  # positions the trunk has cached (the pending one's)
        self.plan = zeros(s, 3)  # see K_LIMIT, FLOOR, ADAPTIVE
        self.temperature = zeros(s, dtype=torch.float32)  # 0: greedy
        self.top_p = torch.ones(s, device=device)
        self.seed = zeros(s)
        self.confidence = zeros(s, k, dtype=torch.float32)  # each draft's probability
        self.draft_probs = zeros(s, k, vocab_size, dtype=torch.float32)  # q, for sampled rows
        # Whether a row's drafts were written by the host (the context's): each is then a
        # point mass, q(d) = 1, and `draft_probs` is not read.
        self.given = zeros(s, dtype=torch.bool)
        # The draft chain's rule (see policy/chain.py): per draft position and bin of the
        # draft's probability, its chance of acceptance; per number of drafts, the survival
        # below which the chain stops.
        self.chain_accept = zeros(k, CONFIDENCE_BINS, dtype=torch.float32)
        self.chain_limit = zeros(k + 1, dtype=torch.float32)
        self.draft_index = torch.arange(k + 1, device=device)  # j as a tensor, made once
        # Benchmarks only (`ahead bench engine --synthetic-acceptance`): per draft position,
        # the probability of keeping the draft, in place of the acceptance rule.
        self.synthetic: torch.Tensor | None = None

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: value for name, value in vars(self).items()
                if isinstance(value, torch.Tensor)}

    def set_rows(self, slots: list[int], **columns: Sequence[object]) -> None:
        """Write host values into the named per-slot buffers (temperature=[...], ...).
        The copies do not wait for the device (a blocking copy to a GPU synchronises with its
        stream, one wait per buffer): a copy from pageable host memory is staged before it
        returns, and the writes queue in order before the step that reads them."""
        index = torch.tensor(slots).to(self.device, non_blocking=True)
        for name, values in columns.items():
            buf = getattr(self, name)
            buf[index] = torch.tensor(values, dtype=buf.dtype).to(self.device, non_blocking=True)

    def idle(self, slot: int) -> None:
        """Make `slot` a row that commits nothing and drafts nothing (the pad rows of a step
        that runs more rows than it has generations), without a copy from the host."""
        for buf in (self.lengths, self.num_drafts, self.plan):
            buf[slot] = 0
