"""`ahead train`: the bundled code model, from corpus to a shippable checkpoint.

Steps: collect and split the corpus, train a byte-level BPE tokenizer, tokenize, then train
trunk + MTP modules on next-token + weighted MTP losses, half the samples in FIM form. The run
directory holds everything needed to resume (`ckpt.pt`, written atomically); `export` writes
the model directory (config.json, bf16 safetensors, tokenizer, corpus manifest).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from engine.model.presets import PRESETS
from engine.model.transformer import Transformer
from engine.model.weights import save_model
from engine.tokenizer import Tokenizer, save_tokenizer_dir, set_fim_order, train_byte_level_bpe
from training.chain_loss import chained_distill_loss
from training.corpus import collect, source_roots, write_manifest
from training.losses import lm_losses

Log = Callable[[str], None]


@dataclass(slots=True)
class TrainConfig:
    out: str
    preset: str = "ahead-small"
    steps: int = 6000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 200
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    fim_rate: float = 0.5
    spm_rate: float = 0.5  # of the FIM samples, the share in suffix-prefix-middle order
    vocab_size: int = 4096
    corpus_chars: int = 60_000_000
    tokenizer_chars: int = 15_000_000
    seed: int = 0
    save_every: int = 200
    eval_batches: int = 8
    head_steps: int = 0  # then this many steps of chained self-distillation of the MTP module
    head_lr: float = 5e-4
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        if self.seq_len < 16 or self.batch_size < 1 or self.steps < 1:
            raise ValueError("need seq_len >= 16, batch_size >= 1 and steps >= 1")
        for name in ("fim_rate", "spm_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def prepare_data(cfg: TrainConfig, log: Log) -> Tokenizer:
    """Corpus, tokenizer and token files in the run directory (reused when present)."""
    out = Path(cfg.out)
    model_dir, data = out / "model", out / "data"
    if (data / "train.npy").exists() and (model_dir / "tokenizer.json").exists():
        return Tokenizer.from_dir(model_dir)
    data.mkdir(parents=True, exist_ok=True)
    log(f"collecting Python source from {', '.join(map(str, source_roots()))}")
    files, texts = collect(source_roots(), cfg.corpus_chars)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(files, model_dir / "corpus-manifest.jsonl")
    train = [texts[f.sha256] for f in files if f.split == "train"]
    heldout = [texts[f.sha256] for f in files if f.split == "heldout"]
    log(f"{len(files)} files after deduplication: {len(train)} train, {len(heldout)} held out, "
        f"{sum(f.chars for f in files) / 1e6:.1f}M characters")
    sample, size = [], 0
    for t in train:  # the tokenizer learns from a prefix of the (hash-ordered) training files
        if size > cfg.tokenizer_chars:
            break
        sample.append(t)
        size += len(t)
    log(f"training a {cfg.vocab_size}-token BPE tokenizer on {size / 1e6:.1f}M characters")
    save_tokenizer_dir(train_byte_level_bpe(sample, cfg.vocab_size), model_dir)
    tok = Tokenizer.from_dir(model_dir)
    for name, docs in (("train", train), ("heldout", heldout)):
        ids = _encode_docs(tok, docs)
        np.save(data / f"{name}.npy", ids)
        log(f"{name}: {len(ids) / 1e6:.1f}M tokens")
    return tok


def _encode_docs(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    assert eot is not None
    parts = []
    for start in range(0, len(docs), 256):
        for ids in tok.encode_batch(docs[start:start + 256]):
            parts.append(np.asarray([*ids, eot], dtype=np.uint16))
    return np.concatenate(parts)


class Batches:
    """Random windows of the token stream; a share of them rearranged into FIM form, cut at
    random points, in one of two orders (as StarCoder trains them):

    PSM  <fim_prefix> P <fim_suffix> S <fim_middle> M <|endoftext|>
    SPM  <fim_prefix> <fim_suffix> S <fim_middle> P M <|endoftext|>

    In SPM the prompt ends with the prefix, which the answer simply continues: typing only
    appends to the prompt, so the KV cache keeps the suffix (see `Tokenizer.fim_prompt`)."""

    def __init__(self, tokens: np.ndarray, tok: Tokenizer, cfg: TrainConfig,
                 rng: np.random.Generator) -> None:
        if tok.fim is None:
            raise ValueError("the tokenizer has no FIM tokens")
        self.tokens, self.cfg, self.rng = tokens, cfg, rng
        eot = tok.token_to_id("<|endoftext|>")
        assert eot is not None
        self.fim, self.eot = tok.fim, eot

    def __call__(self) -> torch.Tensor:
        cfg, rng = self.cfg, self.rng
        starts = rng.integers(0, len(self.tokens) - cfg.seq_len, size=cfg.batch_size)
        rows = [self.tokens[s:s + cfg.seq_len].astype(np.int64) for s in starts]
        for i, row in enumerate(rows):
            if rng.random() < cfg.fim_rate:
                rows[i] = self._fim(row[: cfg.seq_len - 4])
        return torch.from_numpy(np.stack(rows))

    def _fim(self, w: np.ndarray) -> np.ndarray:
        i, j = sorted(self.rng.integers(0, len(w) + 1, size=2))
        f = self.fim
        if self.rng.random() < self.cfg.spm_rate:
            return np.concatenate([[f.prefix, f.suffix], w[j:], [f.middle], w[:j], [self.eot]])
        return np.concatenate([[f.prefix], w[:i], [f.suffix], w[j:], [f.middle], w[i:j],
                               [self.eot]])


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(progress, 1)))


def build(cfg: TrainConfig, tok: Tokenizer) -> Transformer:
    eot = tok.token_to_id("<|endoftext|>")
    mcfg = PRESETS[cfg.preset].with_(vocab_size=tok.vocab_size,
                                     eos_token_ids=() if eot is None else (eot,))
    torch.manual_seed(cfg.seed)
    return Transformer(mcfg).to(cfg.device)


def train(cfg: TrainConfig, log: Log = print) -> Transformer:
    out = Path(cfg.out)
    tok = prepare_data(cfg, log)
    model = build(cfg, tok)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(cfg.seed)
    step, history = _resume(out / "ckpt.pt", model, opt, rng, log)
    train_tokens = np.load(out / "data" / "train.npy", mmap_mode="r")
    heldout = np.load(out / "data" / "heldout.npy", mmap_mode="r")
    batches = Batches(train_tokens, tok, cfg, rng)
    meter = _Meter(cfg, step)
    while step < cfg.steps:
        x = batches().to(cfg.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        with _autocast(cfg.device):
            loss, main, extra = lm_losses(model.train(), x, cfg.mtp_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        meter.update(step, main.item(), [e.item() for e in extra], x.numel(), log)
        if step % cfg.save_every == 0 or step == cfg.steps:
            history.append({"step": step, **evaluate(model, heldout, tok, cfg)})
            log(f"step {step}: held-out loss {history[-1]['heldout_loss']:.3f} "
                f"(mtp {history[-1]['heldout_mtp_loss']:.3f})")
            _save(out / "ckpt.pt", model, opt, rng, step, history)
    if cfg.head_steps:
        # Not resumable on its own: a rerun tunes again from the main checkpoint.
        history.append(tune_heads(model, batches, heldout, tok, cfg, log))
    export(model, tok, out / "model", cfg, history)
    return model


def tune_heads(model: Transformer, batches: Batches, heldout: np.ndarray, tok: Tokenizer,
               cfg: TrainConfig, log: Log) -> dict[str, float]:
    """Chained self-distillation of the MTP module with the trunk frozen (see chain_loss)."""
    if model.num_mtp != 1 or model.cfg.mtp_layers_per_module != 1:
        raise ValueError("chained head tuning needs exactly one single-block MTP module")
    params = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    opt = torch.optim.AdamW(params, lr=cfg.head_lr, weight_decay=0.0)
    t0 = time.perf_counter()
    for step in range(1, cfg.head_steps + 1):
        loss = chained_distill_loss(model.train(), batches().to(cfg.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == cfg.head_steps:
            log(f"head step {step}/{cfg.head_steps} chained distillation {loss.item():.3f} "
                f"({time.perf_counter() - t0:.0f} s)")
    for p in model.parameters():
        p.requires_grad_(True)
    with torch.no_grad():
        x = Batches(heldout, tok, cfg, np.random.default_rng(12345))().to(cfg.device)
        held = chained_distill_loss(model.eval(), x).item()
    log(f"head tuning done: held-out chained distillation loss {held:.3f}")
    return {"head_steps": cfg.head_steps, "heldout_chained_kl": held}


@torch.no_grad()
def evaluate(model: Transformer, tokens: np.ndarray, tok: Tokenizer,
             cfg: TrainConfig) -> dict[str, float]:
    """Mean losses on fixed held-out windows (plain and FIM alike)."""
    batches = Batches(tokens, tok, cfg, np.random.default_rng(12345))
    main_sum = mtp_sum = 0.0
    for _ in range(cfg.eval_batches):
        _, main, extra = lm_losses(model.eval(), batches().to(cfg.device), cfg.mtp_weight)
        main_sum += main.item()
        mtp_sum += sum(e.item() for e in extra) / max(len(extra), 1)
    return {"heldout_loss": main_sum / cfg.eval_batches,
            "heldout_mtp_loss": mtp_sum / cfg.eval_batches}


def _autocast(device: str) -> torch.autocast:
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


class _Meter:
    def __init__(self, cfg: TrainConfig, step: int) -> None:
        self.cfg, self.t0, self.step0, self.tokens = cfg, time.perf_counter(), step, 0
        self.every = 10

    def update(self, step: int, main: float, extra: list[float], ntok: int, log: Log) -> None:
        self.tokens += ntok
        if step % self.every and step != self.cfg.steps:
            return
        dt = time.perf_counter() - self.t0
        rate = self.tokens / max(dt, 1e-9)
        eta = (self.cfg.steps - step) * dt / max(step - self.step0, 1)
        mtp = " ".join(f"{e:.3f}" for e in extra)
        log(f"step {step}/{self.cfg.steps} loss {main:.3f} mtp {mtp} lr "
            f"{lr_at(step, self.cfg):.2e} {rate:,.0f} tok/s eta {eta / 60:.0f} min")


def _save(path: Path, model: Transformer, opt: torch.optim.Optimizer, rng: np.random.Generator,
          step: int, history: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "rng": rng.bit_generator.state, "history": history}, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint whole


def _resume(path: Path, model: Transformer, opt: torch.optim.Optimizer,
            rng: np.random.Generator, log: Log) -> tuple[int, list[dict]]:
    if not path.exists():
        return 0, []
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    rng.bit_generator.state = state["rng"]
    log(f"resuming from step {state['step']} ({path})")
    return int(state["step"]), list(state["history"])


def export(model: Transformer, tok: Tokenizer, model_dir: Path, cfg: TrainConfig,
           history: list[dict]) -> None:
    """The shippable model directory: bf16 weights beside the tokenizer and manifest."""
    save_model(model.eval(), model_dir, dtype=torch.bfloat16)
    if cfg.fim_rate and cfg.spm_rate:  # prompts then end with the prefix (cache-friendly)
        set_fim_order(model_dir, "spm")
    info = {"train_config": asdict(cfg), "history": history}
    (model_dir / "training.json").write_text(json.dumps(info, indent=2) + "\n")
