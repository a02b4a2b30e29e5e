"""Token healing's constraint on a generation's first token: the prompt ends before some text
(`Prompt.forced`), and the first token must start with it. Here, per forced text, the mask of
the vocabulary's tokens that do, built once and kept on the device (an editor's prompts end
in the same few texts: an indent, a partial word's head)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.tokenizer import Tokenizer


class ForcedStarts:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, device
        self._masks: dict[str, torch.Tensor] = {}

    def mask(self, text: str) -> torch.Tensor | None:
        """A mask of the vocabulary's tokens whose text starts with `text` (None for "")."""
        if text and text not in self._masks:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[[i for i in self.tokenizer.ids_starting_with(text) if i < self.vocab_size]] = True
            self._masks[text] = mask.to(self.device)
        return self._masks[text] if text else None

    def allowed(self, forced: Sequence[str]) -> torch.Tensor | None:
        """The tokens each row's first token may be [rows, vocab], or None where no row has
        a forced start."""
        masks = [self.mask(text) for text in forced]
        if all(m is None for m in masks):
            return None
        every = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
        return torch.stack([every if m is None else m for m in masks])
