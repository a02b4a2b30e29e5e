"""Quantized weights: every matmul of the trunk, the MTP modules, the head and the reduced
draft head with its weight in int8 or int4 (engine/model/codes.py); norms, the embedding
lookup and the recurrent state stay as loaded.

Codes are computed from the loaded weights, kept on disk beside nothing of the checkpoint:
`QuantCache` names a file by the checkpoint's files (names, sizes, modification times), the
mode and the group size, so a restart reads codes instead of computing them, and a changed
checkpoint gets new ones. Where our kernels run, the file holds the weights in their layout
(native.pack's, named by its version), and a restart maps it and multiplies from it: no
weight of the checkpoint's that the codes replace is read, and nothing is packed or copied
(Qwen3.5-2B in int8: 5 s of packing and 1.3 s of fusing projections gone from a warm load).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor, nn

from engine import native
from engine.model.codes import Packed, QuantError, QuantLinear, encode
from engine.model.layers import Dense
from engine.model.pages import place_weights
from engine.model.transformer import Transformer
from engine.native import encode as to_layout
from engine.paths import checkpoint_identity, write_replacing

MODES = ("auto", "none", "int8", "int4", "int8dyn")
GROUP = native.GROUPS[0]  # inputs an int4 group (128), narrower layers less
# auto: int8 where our kernels run and the matmuls' weights hold at least this many
# parameters, whatever dtype they are loaded in (so that the dtype may follow the mode:
# `run_dtype`). Measured on 2-core AVX-512 CPUs: Qwen2-1.5B's shapes step 2.6x faster in
# int8 than in bf16 (llama.cpp Q8_0's error: weights and activations in 8 bits); on an EPYC
# Zen 4 the bundled model (8.3M) decodes 2.2x faster in int8 (3.1x with bf16 activations)
# with the same held-out loss (3.251 nats) and `ahead bench quality` figures, and a
# 0.27M-parameter toy (tiny-qwen3) steps 1.1x slower: its step is all overhead. int4 stays a
# choice (more error).
AUTO_PARAMS = 1 << 22
# The drafts' targets, the MTP modules and the reduced draft head: they make drafts alone,
# which the verify accepts or not, so their precision moves acceptance and never the output
# (see `draft_mode`).
DRAFT_HEAD = "draft_head"


def drafts_only(name: str) -> bool:
    """Whether the target `name` makes drafts alone (see `draft_mode`)."""
    return name.startswith("mtp.") or name == DRAFT_HEAD


def targets(model: Transformer) -> dict[str, tuple[object, str]]:
    """Every matmul to quantize (or quantized): name -> (owner, attribute) of a fused `Dense`
    (`Packed`), an nn.Linear (`QuantLinear`), the head (`head_weight`, tied or not) and the
    reduced draft head's rows (DRAFT_HEAD, where the model has one: decode/draft_vocab.py)."""
    out: dict[str, tuple[object, str]] = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "fused", None), Dense | Packed):
            out[f"{name}.fused"] = (module, "fused")
        for child, sub in module.named_children():
            if isinstance(sub, nn.Linear | QuantLinear) and child != "lm_head" and \
                    not _fused_part(module, child):
                out[f"{name}.{child}" if name else child] = (module, child)
    out["head"] = (model, "head_weight")
    if model.draft_head is not None:
        out[DRAFT_HEAD] = (model.draft_head, "rows")
    return out


def _fused_part(module: nn.Module, child: str) -> bool:
    """Whether an nn.Linear is one of its owner's fused projections (run through `fused`)."""
    return isinstance(getattr(module, "fused", None), Dense | Packed) and \
        child in getattr(module, "FUSED", ())


def packed_weights(model: Transformer) -> dict[str, Packed]:
    """The quantized weights by target name (none before `quantize_model`)."""
    out = {}
    for name, (owner, attr) in targets(model).items():
        w = getattr(owner, attr, None)
        w = w.packed if isinstance(w, QuantLinear) else w
        if isinstance(w, Packed):
            out[name] = w
    return out


def quantize_model(model: Transformer, mode: str, cache: QuantCache | None = None) -> int:
    """Replace every target's weight by its `Packed` form (from `cache` where it has it);
    free the full-precision copies. Returns the bytes the quantized weights take."""
    if mode not in MODES:
        raise QuantError(f"quant must be one of {', '.join(MODES)}, not {mode!r}")
    model.quant_asked = mode
    mode = resolve(model, mode)
    if mode == "none":
        return 0
    drafts = draft_mode(model, mode)
    key = mode if drafts == mode else f"{mode}-drafts-{drafts}"  # the cache file's
    device = model.model.embed_tokens.weight.device
    laid_out = device.type == "cpu" and native.available()  # our kernels' layout on disk
    draft_ids = _draft_ids(model)
    stored, source = cache.find(key, mode, laid_out, draft_ids) if cache else ({}, None)
    entries: dict[str, Entry] = {}
    total, computed = 0, False
    for name, (owner, attr) in targets(model).items():
        own = drafts if drafts_only(name) else mode
        bias = _bias_of(owner, attr)
        entry = stored.get(name)
        if entry is None or entry.mode != own:
            weight = _weight_of(model, owner, attr)
            if weight.dtype not in (torch.float32, torch.bfloat16):  # held as stored: fp16
                weight = weight.float()  # exact; straight to our layout (it takes fp32, bf16)
            if laid_out and to_layout.takes(weight, own):  # straight to our kernels' layout
                layout, g = to_layout.laid_out(weight, own)
                entry = Entry(own, g, weight.shape[0], (layout,))
            else:
                c, s, g = encode(weight, own)
                entry = Entry(own, g, c.shape[0], (c, s))
            computed = True
        packed = entry.packed(bias, device)
        entries[name] = entry if not packed.native or len(entry.tensors) == 1 else \
            Entry(own, packed.native_group, packed.out_features, (packed.packed,))
        packed.drop_codes()
        total += packed.nbytes()
        _install(model, owner, attr, packed)
    if cache is not None and (computed or source != cache.path(key, laid_out)):
        cache.write(key, entries, laid_out, draft_ids)
        if source is not None and source != cache.path(key, laid_out):
            source.unlink(missing_ok=True)  # superseded: everything it held is in the new one
    del entries, stored  # their layouts: the ones `place_weights` frees as it copies them
    place_weights(packed_weights(model).values())  # into 2 MB pages (model/pages.py)
    model.quant, model.draft_quant = mode, drafts
    return total


class Entry(NamedTuple):
    """One target's quantized weight as a cache holds it: (codes, scales) as `encode` gives
    them, or (layout,) as `native.pack` gives it; `group`: the codes' (int4) or, for a
    layout, the kernels' activation group; `rows`: the outputs."""

    mode: str
    group: int
    rows: int
    tensors: tuple[Tensor, ...]

    def packed(self, bias: Tensor | None, device: torch.device) -> Packed:
        if len(self.tensors) == 1:
            return Packed.laid_out(self.mode, self.tensors[0], bias, self.group, self.rows)
        codes, scales = (t.to(device) for t in self.tensors)
        return Packed(self.mode, codes, scales, bias, self.group)


def _draft_ids(model: Transformer) -> str:
    """Which rows the draft head holds (a digest of its token ids), "" without one."""
    head = model.draft_head
    if head is None:
        return ""
    return hashlib.sha256(",".join(map(str, head.ids.tolist())).encode()).hexdigest()[:16]


def draft_mode(model: Transformer, mode: str) -> str:
    """What the drafts' matmuls (the MTP modules and the reduced draft head) run in when the
    model runs in `mode`: int4 under int8 where our kernels run (and every such matmul's
    width takes int4's groups), else `mode`. A draft only proposes; the verify, in int8,
    decides every token, so the output is int8's whatever the drafts' precision, and their
    bytes halve (three drafts' MTP layer and draft head were 0.2 of an int8 plain step's
    weights: Qwen3.5-2B's K=3 step 1.33x plain). Called before the weights are replaced."""
    on_cpu = model.model.embed_tokens.weight.device.type == "cpu"
    if mode != "int8" or not on_cpu or not native.available():
        return mode
    widths = [model.cfg.hidden_size] + [_weight_of(model, owner, attr, make=False).shape[1]
                                        for name, (owner, attr) in targets(model).items()
                                        if drafts_only(name)]
    return "int4" if all(native.group_for(w) for w in widths) else mode


def resolve(model: Transformer, mode: str, device_type: str | None = None) -> str:
    """The mode that runs when `mode` is asked for (on a device of this type: a model on the
    meta device, not loaded yet; else the model's)."""
    return choose(model, device_type) if mode == "auto" else mode


def choose(model: Transformer, device_type: str | None = None) -> str:
    """What `auto` runs (see AUTO_PARAMS)."""
    return auto_mode(device_type or model.model.embed_tokens.weight.device.type,
                     matmul_params(model))


def auto_mode(device_type: str, params: int) -> str:
    """What `auto` runs on a device of this type for matmul weights of `params` parameters."""
    return "int8" if device_type == "cpu" and params >= AUTO_PARAMS and native.available() \
        else "none"


def matmul_params(model: Transformer) -> int:
    """Parameters in the weights of every quantization target."""
    return sum(_weight_of(model, owner, attr, make=False).numel()
               for owner, attr in targets(model).values())


def run_dtype(device_type: str, mode: str) -> torch.dtype:
    """The dtype a model runs in where none is asked for, `mode` its quantization (resolved):
    bf16 on CUDA; on a CPU, bf16 where our kernels multiply its weights (int8, int4) and the
    CPU has AVX512-BF16 for attention's dot products; else fp32 (what torch's CPU kernels run
    best, and what the bundled model was trained in). Measured on an EPYC Zen 4, Qwen2-1.5B's
    shapes in int4, one thread: a plain step 40.6 ms in bf16, 53.9 in fp32; K=3 58.2 against
    80.3."""
    if device_type != "cpu":
        return torch.bfloat16
    quantized = mode in ("int8", "int4") and native.available()
    return torch.bfloat16 if quantized and native.kernels().bf16_dot else torch.float32


def describe(model: Transformer) -> str:
    """The mode and whose kernels run it: "int4 (vnni kernels)", "int8 (torch kernels: this
    CPU lacks avx512_vnni)", "none", "none (auto)"."""
    mode = getattr(model, "quant", "none")
    auto = " (auto)" if getattr(model, "quant_asked", mode) == "auto" else ""
    packed = packed_weights(model)
    if mode == "none" or not packed:
        return mode + auto
    drafts = f"; drafts {model.draft_quant}" if model.draft_quant != mode else ""
    if all(p.native for p in packed.values()):
        return f"{mode} ({native.flavour()} kernels{drafts}){auto}"
    why = native.status() if mode in ("int4", "int8") and \
        model.model.embed_tokens.weight.device.type == "cpu" else ""
    return f"{mode} (torch kernels{': ' + why if why != 'vnni' and why else ''}){auto}"


def _weight_of(model: Transformer, owner: object, attr: str, make: bool = True) -> Tensor:
    """The full-precision weight of a target: a deferred fused one (`fuse_linears`) made
    here from the projections it fuses, or (`make` False: for its shape and dtype) as it is,
    on the meta device."""
    if attr == "head_weight":
        return model.head_matrix().detach()
    target = getattr(owner, attr)
    if isinstance(target, Dense) and target.deferred and make:
        parts = getattr(owner, "FUSED", ())
        return torch.cat([getattr(owner, part).weight.detach() for part in parts])
    return target.weight.detach()


def _bias_of(owner: object, attr: str) -> Tensor | None:
    bias = None if attr == "head_weight" else getattr(getattr(owner, attr), "bias", None)
    return None if bias is None else bias.detach()


def _install(model: Transformer, owner: object, attr: str, packed: Packed) -> None:
    """Put `packed` in place and drop the full-precision weight it replaces (the embedding a
    tied head shares stays: the lookup needs it)."""
    empty = torch.empty(0, device=model.model.embed_tokens.weight.device)
    if attr == "head_weight":
        model.head_weight = packed
        if not model.cfg.tie_word_embeddings:
            model.lm_head.weight.data = empty
    elif attr in ("fused", "rows"):  # a fused projection, the draft head's rows
        setattr(owner, attr, packed)
        for child in getattr(owner, "FUSED", ()):  # views into the fused weight, or its parts
            getattr(owner, child).weight.data = empty
    else:
        assert isinstance(owner, nn.Module)
        setattr(owner, attr, QuantLinear(packed))


class QuantCache:
    """One checkpoint's quantized weights on disk (see the module's docstring): a file a mode
    (and the drafts' mode, where theirs differs), in codes or in our kernels' layout."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        identity = checkpoint_identity(model_dir)
        self.key = hashlib.sha256(identity.encode()).hexdigest()[:24]
        self.root = root
        self.source = str(Path(model_dir).resolve())  # written into each file: see `write`

    def path(self, key: str, laid_out: bool = False) -> Path:
        """`key`: the mode, or "<mode>-drafts-<mode>"; `laid_out`: in our kernels' layout."""
        layout = f"-wq{native.LAYOUT}" if laid_out else ""
        return self.root / f"{self.key}-{key}-g{GROUP}{layout}.safetensors"

    def find(self, key: str, mode: str, laid_out: bool,
             draft_ids: str) -> tuple[dict[str, Entry], Path | None]:
        """What the cache has for `key` and the file it came from: that file in the layout
        (where `laid_out`), else in codes, else the codes of the whole model in `mode` (a
        cache from before the drafts had their own mode: its trunk and head serve)."""
        for path in dict.fromkeys([*([self.path(key, True)] if laid_out else []),
                                   self.path(key), self.path(mode)]):
            got = self.read(path, mode if path == self.path(mode) else key, draft_ids)
            if got is not None:
                return got, path
        return {}, None

    def read(self, path: Path, key: str, draft_ids: str = "") -> dict[str, Entry] | None:
        """The entries of one file (`path(key, ...)`), None where it is missing or unreadable;
        the draft head's only where it holds the rows `draft_ids` names. An entry in our
        kernels' layout of another version is left out (computed again)."""
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                groups = json.loads(meta.get("groups", "{}"))
                modes = json.loads(meta["modes"]) if "modes" in meta else \
                    _modes_of(key, groups)
                rows = json.loads(meta.get("rows", "{}"))
                layout = meta.get("layout") == str(native.LAYOUT)
                names = set(f.keys())
                out = {}
                for name, group in groups.items():
                    if name == DRAFT_HEAD and meta.get("draft_ids") != draft_ids:
                        continue
                    if f"{name}.layout" in names:
                        if layout:
                            out[name] = Entry(modes[name], int(group), int(rows[name]),
                                              (f.get_tensor(f"{name}.layout"),))
                        continue
                    codes = f.get_tensor(f"{name}.codes")
                    out[name] = Entry(modes[name], int(group), codes.shape[0],
                                      (codes, f.get_tensor(f"{name}.scales")))
                return out
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
            return None  # unreadable or partial: computed again, and written anew

    def write(self, key: str, entries: dict[str, Entry], laid_out: bool,
              draft_ids: str) -> None:
        tensors = {}
        for name, entry in entries.items():
            parts = ("layout",) if len(entry.tensors) == 1 else ("codes", "scales")
            for part, t in zip(parts, entry.tensors, strict=True):
                tensors[f"{name}.{part}"] = t.contiguous().cpu()
        meta = {"groups": {n: e.group for n, e in entries.items()},
                "modes": {n: e.mode for n, e in entries.items()},
                "rows": {n: e.rows for n, e in entries.items()}}
        metadata = {k: json.dumps(v) for k, v in meta.items()}
        metadata.update(layout=str(native.LAYOUT), draft_ids=draft_ids, source=self.source)
        path = self.path(key, laid_out)
        write_replacing(path, lambda tmp: save_aligned(tensors, tmp, metadata))
        for stale in self.root.glob(f"{self.key}-{key}-g{GROUP}-wq*.safetensors"):
            if stale != path:  # a layout of another version: what it held is in this one
                stale.unlink(missing_ok=True)
        for other in self.root.glob("*.safetensors"):  # this directory's checkpoint before
            if not other.name.startswith(self.key) and _source(other) == self.source:
                other.unlink(missing_ok=True)  # it changed (a daemon mapping it keeps it)


ALIGN = 64  # bytes: a cache line, and what the kernels' tiles start on in memory
_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int32: "I32", torch.int64: "I64"}


def save_aligned(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file (read back by the safetensors library) whose tensors of a whole
    number of ALIGN bytes start ALIGN-aligned in the file, and so in a mapping of it: they
    come first, after a header padded with spaces (as the format allows). safetensors' own
    writer aligns to 8 bytes, and a verify's products ran ~2% slower from such a mapping."""
    def size(t: Tensor) -> int:
        return t.numel() * t.element_size()

    order = sorted(tensors, key=lambda name: size(tensors[name]) % ALIGN != 0)
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size(t)]}
        offset += size(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            t = tensors[name].contiguous()
            if size(t):
                f.write(memoryview((ctypes.c_char * size(t)).from_address(t.data_ptr())))


def _source(path: Path) -> str | None:
    """The checkpoint directory a cache file was written for (its metadata), or None:
    unreadable, or written before files said."""
    try:
        with safe_open(str(path), framework="pt") as f:
            source = (f.metadata() or {}).get("source")
    except (OSError, ValueError, TypeError):
        return None
    return source if isinstance(source, str) else None


def _modes_of(key: str, groups: dict[str, int]) -> dict[str, str]:
    """Each entry's mode in a file of codes written before files said, from its key
    ("<mode>[-drafts-<mode>]"): the drafts' in the MTP modules."""
    mode, _, drafts = key.partition("-drafts-")
    return {n: (drafts or mode) if drafts_only(n) else mode for n in groups}
