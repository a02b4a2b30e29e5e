"""A cheap draft: drafts score a reduced vocabulary, verification the whole one (FR-Spec).

A draft runs the head over the whole vocabulary: 151k-248k rows, a sixth to a quarter of a
1.5B-2B model's weights, read again for every draft. Most of the probability mass of code
sits on far fewer tokens, so a draft scores only the `size` most frequent tokens of a code
corpus in the model's own tokenizer (the interpreter's standard library: every machine has
it), plus every special and stop token, and the rest get -inf. Lossless as before: the
verify scores the whole vocabulary, and a sampled draft's distribution q is the one it was
drawn from (zero outside the subset), which speculative sampling needs and nothing more.

The ranking is computed once per tokenizer and kept in ~/.cache/ahead/draft-vocab.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

from engine.model.codes import Packed
from engine.model.layers import Dense
from engine.model.transformer import Transformer
from engine.native import pick
from engine.native.layout import TILE
from engine.paths import cache_dir, write_replacing
from engine.tokenizer import Tokenizer

SIZE = 32768  # FR-Spec's choice for Llama 3's 128k vocabulary
# Tiles of 16 rows a greedy draft's coarse pass hands to the exact one (`DraftHead.greedy`).
# Over random 32768 x 2048 rows (the flattest logits) the pick is the int4 rows' argmax in
# 95.4% of drafts at 64 tiles (98.8% at 128); on the bundled model's head (`ahead bench
# draft-pick`) acceptance is the int4 rows' from 16 tiles on.
CANDIDATES = 64
CORPUS_CHARS = 4_000_000


def corpus() -> list[str]:
    """Python source that ships with the interpreter, the first CORPUS_CHARS characters."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= CORPUS_CHARS:
            break
    return texts


def ranked_ids(tokenizer: Tokenizer, vocab_size: int, size: int,
               root: Path | None = None) -> list[int]:
    """The `size` most frequent ids in the corpus, with every special and stop id (then the
    lowest ids, where the corpus shows fewer), sorted."""
    key = hashlib.sha256(json.dumps([tokenizer.fingerprint(), vocab_size, size,
                                     CORPUS_CHARS]).encode()).hexdigest()[:24]
    path = (root or cache_dir("draft-vocab")) / f"{key}.json"
    try:
        return [int(i) for i in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        pass
    counts: Counter[int] = Counter()
    for ids in tokenizer.encode_batch(corpus()):
        counts.update(ids)
    keep = {i for i in (*tokenizer.special_ids, *tokenizer.stop_ids) if i < vocab_size}
    keep |= {i for i, _ in counts.most_common(max(0, size - len(keep))) if i < vocab_size}
    # Fewer seen than asked for: the lowest ids next (a BPE's earliest, most frequent merges).
    keep |= set(itertools.islice((i for i in range(vocab_size) if i not in keep),
                                 max(0, size - len(keep))))
    ids = sorted(keep)
    write_replacing(path, lambda tmp: tmp.write_text(json.dumps(ids)))
    return ids


class DraftHead:
    """The head's rows for `ids`: logits [..., V] with -inf outside them. Made from the
    full-precision head, before quantization, which encodes the rows as one of its targets
    (in the drafts' precision: quant.draft_mode).

    Where the rows are int4 in our kernels' layout, a greedy draft reads half their bytes
    (`greedy`): a coarse pass over a 2-bit form of them (each int4 code rounded to one of
    four levels, 2.25 bits a weight with the scales) finds the `candidates` tiles of 16 rows
    with the highest logits, and the int4 rows score those tiles exactly; the draft is the
    best of these. A draft only proposes (the verify scores the whole vocabulary), so output is
    unchanged whatever it picks; it is the int4 rows' argmax wherever that is among the
    candidates (CANDIDATES)."""

    def __init__(self, model: Transformer, ids: list[int],
                 candidates: int = CANDIDATES) -> None:
        device = model.model.embed_tokens.weight.device
        self.ids = torch.tensor(ids, device=device)
        self.vocab_size = model.cfg.vocab_size
        if model.head_weight is not None:
            raise ValueError("the draft head is made before the model is quantized "
                             "(quantize_model encodes its rows)")
        self.rows: Dense | Packed = Dense(model.head_matrix().detach()[self.ids].contiguous())
        self.candidates = candidates
        self._coarse: tuple[Packed, Tensor] | None = None  # (rows it was made of, layout)

    def coarse(self) -> Tensor | None:
        """The rows' 2-bit layout where the rows are int4 in our kernels' layout and a
        coarse pass pays (candidates' tiles fewer than half the rows'), else None; made
        once for the rows it is made of."""
        rows = self.rows
        if not isinstance(rows, Packed) or not rows.native or rows.mode != "int4" \
                or self.candidates <= 0 or 2 * self.candidates * TILE > rows.out_features:
            return None
        if self._coarse is None or self._coarse[0] is not rows:
            self._coarse = rows, pick.coarse_layout(rows.packed, rows.native_group)
        return self._coarse[1]

    def greedy(self, x: Tensor, prob: bool) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Per row of x [..., H]: the index among `ids` of its draft, that row's logit and
        (`prob`) the log-sum-exp of its logits, the coarse pass's outside the tiles scored
        exactly (wq.c `wq_draft_pick`); None where there is no coarse pass (`coarse`)."""
        layout = self.coarse()
        if layout is None:
            return None
        rows = self.rows
        assert isinstance(rows, Packed)
        return pick.draft_pick(x, layout, rows.packed, rows.out_features, rows.native_group,
                               self.candidates, prob)

    def __call__(self, x: Tensor) -> Tensor:
        sub = self.rows(x)  # [..., n]
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, sub)

    def nbytes(self) -> int:
        rows = self.rows
        if isinstance(rows, Packed):
            return rows.nbytes()
        return rows.weight.numel() * rows.weight.element_size()


def install(model: Transformer, tokenizer: Tokenizer, size: int = SIZE) -> DraftHead | None:
    """Give the model's drafts the reduced head where it saves much (the vocabulary more than
    twice `size`); None where it does not or the model drafts nothing."""
    vocab = model.cfg.vocab_size
    if not model.num_mtp or size <= 0 or vocab <= 2 * size:
        return None
    head = DraftHead(model, ranked_ids(tokenizer, vocab, size))
    model.draft_head = head
    return head
