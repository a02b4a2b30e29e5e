"""`ahead bench draft-pick`: what the greedy drafts' coarse pass costs in acceptance.

Where the reduced draft head is int4 in our CPU kernels' layout, a greedy draft scores a
2-bit form of its rows first and only the best tiles of 16 rows exactly
(engine/decode/draft_vocab.py `DraftHead.greedy`): half the bytes, and a draft that is the
int4 rows' own argmax only where that lies in those tiles. This decodes held-out contexts
from the files given at a fixed K for each number of candidate tiles (0: the int4 rows
score every draft, as without the pass) and reports, per count, the drafts' acceptance and
how often the pass picked the int4 rows' argmax. The output is plain decoding's whatever
the drafts, so only acceptance can move.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from clients.bench.draft_vocab import source_files
from engine import Engine, GenParams, native
from engine.decode.draft_vocab import CANDIDATES
from engine.model.codes import Packed


def contexts(engine: Engine, files: list[Path], count: int, length: int,
             seed: int = 0) -> list[list[int]]:
    """`count` contexts of `length` tokens at seeded places of the files (each file long
    enough gives one, in turn, until there are enough)."""
    rng = random.Random(seed)
    encoded = [engine.tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
               for f in files]
    long = [ids for ids in encoded if len(ids) >= 2 * length]
    out: list[list[int]] = []
    while long and len(out) < count:
        for ids in long[:count - len(out)]:
            at = rng.randrange(length, len(ids) - length // 2)
            out.append(ids[at - length:at])
    return out


def bench_draft_pick(model_dir: Path, paths: list[Path], tiles: list[int], *,
                     draft_vocab: int, prompts: int = 24, context: int = 200,
                     tokens: int = 48, k: int = 3) -> dict[str, Any]:
    """Per candidate count in `tiles`: drafts, acceptance, and the share of greedy drafts
    that are the int4 draft head's argmax, over `prompts` contexts of the files."""
    if not tiles or min(tiles) < 0:
        raise ValueError(f"tile counts must be 0 or more, not {tiles}")
    if native.status() != "vnni":
        raise ValueError(f"the coarse pass needs our CPU kernels: {native.status()}")
    files = source_files(paths)
    if not files:
        raise ValueError("no source files among the paths given")
    engine = Engine.load(model_dir, dtype=torch.float32, max_seq_len=context + tokens + 16,
                         k_max=k, slots=1, quant="int4", draft_vocab=draft_vocab)
    head = engine.model.draft_head
    if head is None or not engine.model.num_mtp:
        raise ValueError(f"no reduced draft head: the model needs MTP modules and a "
                         f"vocabulary more than twice --draft-vocab {draft_vocab} "
                         f"(it has {engine.model.cfg.vocab_size})")
    chosen = contexts(engine, files, prompts, context)
    if not chosen:
        raise ValueError(f"no file among the paths has {2 * context} tokens")
    rows = head.rows
    assert isinstance(rows, Packed)
    seen = {"drafts": 0, "same": 0}
    pick = head.greedy

    def compared(x: torch.Tensor, prob: bool) -> tuple[Any, ...] | None:
        """The pass's pick, counted against the int4 rows' argmax."""
        got = pick(x, prob)
        full = rows.top(x)
        if got is not None and full is not None:
            seen["drafts"] += got[0].numel()
            seen["same"] += int((got[0] == full[1]).sum())
        return got

    head.greedy = compared  # type: ignore[method-assign]
    results: dict[str, Any] = {}
    for count in tiles:
        head.candidates = count
        seen.update(drafts=0, same=0)
        engine.drafting.totals.clear()
        for ids in chosen:
            engine.generate(ids, GenParams(tokens, k=k, stop_loops=False, drafts="mtp"))
        mtp = engine.drafting.report().get("mtp", {})
        results[str(count)] = {
            "coarse_pass": head.coarse() is not None, "drafted": int(mtp.get("drafted", 0)),
            "acceptance": mtp.get("acceptance", 0.0),
            "agreement": round(seen["same"] / seen["drafts"], 4) if seen["drafts"] else None}
    return {"model": str(model_dir), "vocab_size": engine.model.cfg.vocab_size,
            "draft_rows": rows.out_features, "prompts": len(chosen), "context": context,
            "tokens": tokens, "k": k, "default_tiles": CANDIDATES,
            "tiles": results}


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['model']}: a reduced draft head of {r['draft_rows']} rows in int4, "
             f"{r['prompts']} contexts of {r['context']} tokens, {r['tokens']} generated each "
             f"at K={r['k']} (the engine's tiles: {r['default_tiles']})",
             f"{'tiles':>6} {'pass':>5} {'drafts':>7} {'acceptance':>11} {'same as int4':>13}"]
    for count, row in r["tiles"].items():
        same = "-" if row["agreement"] is None else f"{row['agreement']:.1%}"
        lines.append(f"{count:>6} {'on' if row['coarse_pass'] else 'off':>5} "
                     f"{row['drafted']:>7} {row['acceptance']:>11.3f} {same:>13}")
    if any(not row["coarse_pass"] for count, row in r["tiles"].items() if count != "0"):
        lines.append("(pass off: the tiles' rows would be more than half the head's)")
    return "\n".join(lines)
