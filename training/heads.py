"""MTP heads for a model that has none: train new modules on the frozen model's own outputs.

Self-distillation: on ordinary text, module 0 at position t learns the trunk's own
distribution for token t+2 (its prediction at position t+1), so drafts imitate exactly what
verification will accept. Only the new modules train; they are saved as a separate safetensors
file (`mtp-heads.safetensors`) that the loader picks up beside the untouched checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.model.layers import rope_tables
from engine.model.mtp import MTPModule
from engine.model.transformer import Transformer
from engine.model.weights import HEADS_FILE, load_model, to_checkpoint_name
from engine.tokenizer import Tokenizer
from training.chain_loss import chained_distill_loss
from training.corpus import collect, source_roots

Batches = Callable[[], torch.Tensor]


def with_new_heads(base: Transformer, num_modules: int = 1,
                   naming: str = "deepseek") -> Transformer:
    """A copy of `base` with fresh MTP modules whose blocks start as the trunk's last layer."""
    cfg = base.cfg.with_(num_mtp_modules=num_modules, mtp_naming=naming, mtp_layers_per_module=1)
    model = Transformer(cfg).to(base.model.embed_tokens.weight.device)
    trunk = {k: v for k, v in base.state_dict().items() if not k.startswith("mtp.")}
    model.load_state_dict(trunk, strict=False)
    last = base.model.layers[-1].state_dict()
    for module in model.mtp:
        assert isinstance(module, MTPModule)
        module.blocks[0].load_state_dict(last)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    return model


def distill_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """KL(trunk's distribution for x_{t+2} || module's), averaged over modules and positions."""
    with torch.no_grad():
        seqlen = tokens.shape[1]
        rope = rope_tables(model.cfg, seqlen, tokens.device, model.model.embed_tokens.weight.dtype)
        h = model.trunk(tokens, rope)
        teacher = F.log_softmax(model.head(h[:, 1:]).float(), dim=-1)  # row t: x_{t+2}
    short = (rope[0][:-1], rope[1][:-1])
    losses = []
    for m in range(model.num_mtp):
        out = model.mtp_forward(m, h[:, :-1], tokens[:, 1:], short)
        student = F.log_softmax(model.mtp_logits(m, out).float(), dim=-1)
        losses.append(F.kl_div(student, teacher, log_target=True, reduction="batchmean")
                      / (seqlen - 1))
    return torch.stack(losses).mean()


def train_heads(model: Transformer, batches: Batches, *, steps: int, lr: float = 1e-3,
                log: Callable[[str], None] = print) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        # One module is trained as decoding chains it; several get the depth-1 objective.
        one = model.num_mtp == 1
        loss = (chained_distill_loss if one else distill_loss)(model.train(), batches())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps:
            log(f"heads step {step}/{steps} distillation loss {losses[-1]:.4f} "
                f"({time.perf_counter() - t0:.0f} s)")
    return losses


def save_heads(model: Transformer, model_dir: str | Path) -> Path:
    """Write only the MTP modules, under the checkpoint names of their naming."""
    cfg = model.cfg
    tensors = {to_checkpoint_name(n, cfg): t.detach().contiguous().cpu()
               for n, t in model.state_dict().items() if n.startswith("mtp.")}
    path = Path(model_dir) / HEADS_FILE
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "num_mtp_modules":
                                           str(cfg.num_mtp_modules), "mtp_naming": cfg.mtp_naming})
    tmp.replace(path)
    return path


def corpus_batches(model_dir: str | Path, batch_size: int, seq_len: int, seed: int = 0,
                   max_chars: int = 8_000_000) -> Batches:
    """Random windows of training-split standard-library source, in the model's tokens."""
    tok = Tokenizer.from_dir(model_dir)
    files, texts = collect(source_roots()[:1], max_chars)
    docs = [texts[f.sha256] for f in files if f.split == "train"]
    ids = torch.tensor([i for seq in tok.encode_batch(docs) for i in seq], dtype=torch.long)
    if len(ids) <= seq_len:
        raise ValueError("too little training text for the heads")
    gen = torch.Generator().manual_seed(seed)

    def batch() -> torch.Tensor:
        starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=gen)
        return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])

    return batch


def heads_for(model_dir: str | Path, batches: Batches, *, steps: int, lr: float = 1e-3,
              log: Callable[[str], None] = print) -> Path:
    """The whole `--heads-only` job on a model directory."""
    base = load_model(model_dir, heads=False)  # an earlier heads file is replaced
    if base.num_mtp:
        raise ValueError(f"{model_dir} already has MTP modules of its own")
    model = with_new_heads(base)
    train_heads(model, batches, steps=steps, lr=lr, log=log)
    return save_heads(model, model_dir)
