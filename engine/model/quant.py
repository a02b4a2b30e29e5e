"""Quantized weights: every matmul of the trunk, the MTP modules and the head with its weight
in int8 (one scale per output row) or int4 (a scale and a zero per group of inputs); norms,
the embedding lookup and the recurrent state stay as loaded.

On a memory-bound machine a decoding step costs the bytes of weights it reads: int8 reads a
quarter of fp32, int4 an eighth (plus its scales). Who multiplies:

- on CPUs with AVX-512 VNNI, our kernels (engine/native): int8 activations per group of
  inputs (as llama.cpp's Q8_0), integer dot products, weights streamed once per call for all
  its rows (a verify of 4 rows costs about 1.2 rows), a row's bits its own;
- elsewhere torch's: `aten._weight_int8pack_mm` (CPU, bf16 activations, one row at a time),
  `aten._weight_int4pack_mm_for_cpu` (CPU) or `aten._weight_int4pack_mm` (tinygemm, CUDA),
  groups of 128 inputs (64 or 32 where a layer is narrower);
- int8dyn: int8 weights and int8 activations (one scale per row) with `torch._int_mm`
  (oneDNN's integer GEMM), CPU only.

Measured on a 2-core AVX-512/AMX CPU, one thread, Qwen2-1.5B's shapes, bf16, a step after
512 tokens (`ahead bench engine --preset qwen2-1.5b --quant ...`): plain step int4 94 ms with
our kernels, 163 with torch's; int8 144 and 282 (bf16 unquantized 371; 446 before our
attention kernel). torch's kernels run one row at a time: a verify of 4 rows cost them
1.6-2x a plain step, and a 512-token prefill 6x bf16's.

Codes are computed from the loaded weights (round to nearest; int4 asymmetric, min-max per
group), kept on disk beside nothing of the checkpoint: `QuantCache` names a file by the
checkpoint's files (names, sizes, modification times), the mode and the group size, so a
restart reads codes instead of computing them, and a changed checkpoint gets new ones.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from engine import native
from engine.model.layers import Dense
from engine.model.transformer import Transformer
from engine.paths import checkpoint_identity, write_replacing

MODES = ("auto", "none", "int8", "int4", "int8dyn")
GROUP = native.GROUPS[0]  # inputs an int4 group (128), narrower layers less
# auto: int8 where our kernels run and the matmuls' weights take at least this many bytes as
# loaded. Measured on a 2-core AVX-512 CPU: Qwen2-1.5B's shapes (3 GB in bf16) step 2.6x
# faster in int8 (llama.cpp Q8_0's error: weights and activations in 8 bits); int4 stays a
# choice (more error). The bundled model (32 MB in fp32) decodes 1.2x faster in int8 with the
# same held-out loss, but it stays as trained until the quality bench says the same of it.
AUTO_BYTES = 1 << 30
ACT = torch.bfloat16
# The MTP modules' targets: they make drafts alone, which the verify accepts or not, so their
# precision moves acceptance and never the output (see `draft_mode`).
DRAFTS = "mtp."


class QuantError(ValueError):
    """A quantization mode this model or device cannot run."""


class Packed:
    """x W^T + b with W quantized: the same call as `Dense`."""

    __slots__ = ("bias", "bias32", "codes", "group", "mode", "native", "native_group",
                 "out_features", "packed", "raw_scales", "scales")

    def __init__(self, mode: str, codes: Tensor, scales: Tensor, bias: Tensor | None,
                 group: int = 0) -> None:
        """codes: int8 [N, K] (int8), or [N, K / 2] uint8, two 4-bit codes a byte (int4);
        scales: [N] (int8) or [N, K / group, 2] scale and zero (int4), fp32."""
        self.mode, self.codes, self.group, self.bias = mode, codes, group, bias
        self.out_features, self.raw_scales = codes.shape[0], scales
        self.native = False  # our kernels (engine/native) multiply, else torch's
        cuda = codes.device.type == "cuda"
        in_features = codes.shape[1] * (2 if mode == "int4" else 1)
        self.native_group = group or native.group_for(in_features) or 0
        if not cuda and mode in ("int8", "int4") and native.available() and self.native_group:
            self.native = True
            self.packed = native.pack(mode, codes, scales, self.native_group)
            self.scales = scales.new_empty(0)
            self.bias32 = None if bias is None else bias.float().contiguous()
            return
        if mode in ("int8", "int8dyn"):
            if cuda:
                raise QuantError(f"{mode} has no CUDA path here yet: use quant = \"int4\"")
            self.packed = codes.t() if mode == "int8dyn" else codes  # [K, N] for _int_mm
            self.scales = scales.float() if mode == "int8dyn" else scales.to(ACT)
        else:
            rows = -codes.shape[0] % 16  # the int4 layouts tile 16 outputs: zero rows pad
            q = F.pad(torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1),
                      (0, 0, 0, rows))
            scales = F.pad(scales, (0, 0, 0, 0, 0, rows))
            if cuda:  # tinygemm's layout: uint8 nibbles, then tiles
                self.packed = torch.ops.aten._convert_weight_to_int4pack(
                    (q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
            else:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    q.to(torch.int32), 1)
            self.scales = scales.transpose(0, 1).contiguous().to(ACT)  # [K / group, N, 2]

    def __call__(self, x: Tensor) -> Tensor:
        if self.native:
            return native.linear(x, self.packed, self.bias32, 4 if self.mode == "int4" else 8,
                                 self.out_features, self.native_group)
        if self.mode == "int8dyn":
            return self._dynamic(x)
        rows = x.reshape(-1, x.shape[-1]).to(ACT)
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.packed, self.scales)
        elif rows.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.group, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group,
                                                           self.scales)
        y = y[:, :self.out_features].to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def rows(self, index: Tensor) -> Packed:
        """The product by the rows `index` of W alone (their codes, as they are)."""
        return Packed(self.mode, self.codes[index], self.raw_scales[index],
                      None if self.bias is None else self.bias[index], self.group)

    def recoded(self, mode: str) -> Packed:
        """The same product in `mode`, encoded from what these codes stand for (where the
        full-precision weight is gone: a quantized head's draft rows)."""
        codes, scales, group = encode(decode(self.codes, self.raw_scales, self.mode,
                                             self.group), mode)
        return Packed(mode, codes, scales, self.bias, group)

    def _dynamic(self, x: Tensor) -> Tensor:
        """int8 activations too, one scale per row (so a row's result is its own), and an
        integer matmul: int32 sums are exact in any order, so the kernel's blocking, and
        how many rows share the call, cannot change a bit; its weights are read once for all
        rows (a verify of several rows costs about one)."""
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        acc = torch._int_mm(torch.round(rows / scale).to(torch.int8), self.packed)
        y = (acc.float() * scale * self.scales).to(x.dtype).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


class QuantLinear(nn.Module):
    """An nn.Linear whose weight is `Packed` (the module call sites stay as they are)."""

    def __init__(self, packed: Packed) -> None:
        super().__init__()
        self.packed = packed

    def forward(self, x: Tensor) -> Tensor:
        return self.packed(x)


def group_size(in_features: int) -> int:
    """Inputs per int4 group: GROUP, or the largest of 64, 32 that divides a narrower row
    (the kernels' activation groups are the same)."""
    group = native.group_for(in_features)
    if group is None:
        raise QuantError(f"int4 needs a layer width divisible by 32, not {in_features}")
    return group


def encode(weight: Tensor, mode: str) -> tuple[Tensor, Tensor, int]:
    """(codes, scales, group) of `weight` [N, K]: see `Packed`. Row blocks of ENCODE_ROWS at
    a time, so that the fp32 temporaries stay in cache (a 2B model's first load spent 24 s
    here on whole-matrix passes)."""
    parts = [_encode(block.float(), mode) for block in weight.split(ENCODE_ROWS)]
    codes, scales = (torch.cat([p[i] for p in parts]) for i in (0, 1))
    return codes, scales, 0 if mode in ("int8", "int8dyn") else group_size(weight.shape[1])


ENCODE_ROWS = 256


def _encode(w: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    # In place after the first operation: a fresh block-sized temporary for each step took
    # half of the time (a 2B model's first load: ~13 s -> ~6 s), for the same values.
    if mode in ("int8", "int8dyn"):
        scale = w.abs().amax(dim=1).clamp_(min=1e-12) / 127
        codes = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return codes, scale
    group = group_size(w.shape[1])
    wg = w.view(w.shape[0], -1, group)  # [N, K / g, g]
    low, high = torch.aminmax(wg, dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp_(min=1e-12)
    q = (wg - low).div_(scale).round_().clamp_(0, 15).to(torch.uint8).view(w.shape[0], -1)
    # The kernels compute (q - 8) * scale + zero: the zero is the value of code 8.
    scales = torch.cat([scale, low + 8 * scale], dim=-1)  # [N, K / g, 2]
    return (q[:, ::2] | q[:, 1::2] << 4).contiguous(), scales


def decode(codes: Tensor, scales: Tensor, mode: str, group: int) -> Tensor:
    """The weight [N, K] (fp32) the codes stand for: what the kernels multiply by."""
    if mode in ("int8", "int8dyn"):
        return codes.float() * scales.float()[:, None]
    q = torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1, group).float()
    return ((q - 8) * scales[..., :1] + scales[..., 1:]).view(codes.shape[0], -1)


def targets(model: Transformer) -> dict[str, tuple[nn.Module, str]]:
    """Every matmul to quantize (or quantized): name -> (owner, attribute) of a fused `Dense`
    (`Packed`), an nn.Linear (`QuantLinear`) or the head (`head_weight`, tied or not)."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "fused", None), Dense | Packed):
            out[f"{name}.fused"] = (module, "fused")
        for child, sub in module.named_children():
            if isinstance(sub, nn.Linear | QuantLinear) and child != "lm_head" and \
                    not _fused_part(module, child):
                out[f"{name}.{child}" if name else child] = (module, child)
    out["head"] = (model, "head_weight")
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
    """Replace every target's weight by its `Packed` form (codes from `cache` when it has
    them); free the full-precision copies. Returns the bytes the quantized weights take."""
    if mode not in MODES:
        raise QuantError(f"quant must be one of {', '.join(MODES)}, not {mode!r}")
    model.quant_asked = mode
    mode = resolve(model, mode)
    if mode == "none":
        return 0
    drafts = draft_mode(model, mode)
    key = mode if drafts == mode else f"{mode}-drafts-{drafts}"  # the cache file's
    found = targets(model)
    stored, stored_as = None, key
    if cache is not None:
        stored = cache.read(key)
        if stored is None and key != mode:
            # codes of the whole model in `mode` (a cache from before the drafts had their
            # own): the trunk's and the head's serve, the modules' are made again
            stored, stored_as = cache.read(mode), mode
    codes: dict[str, tuple[Tensor, Tensor, int]] = {}
    total = 0
    for name, (owner, attr) in found.items():
        weight, bias = _weight_of(model, owner, attr)
        own = drafts if name.startswith(DRAFTS) else mode
        if stored is not None and name in stored and (stored_as == key or own == mode):
            c, s, g = stored[name]
        else:
            c, s, g = encode(weight, own)
        codes[name] = (c, s, g)
        packed = Packed(own, c.to(weight.device), s.to(weight.device), bias, g)
        if name != "head" and (own == "int4" or packed.native):  # the repacked form runs;
            packed.codes = c.new_empty(0)  # only the head's codes serve again (draft rows)
        total += packed.nbytes()
        _install(model, owner, attr, packed)
    if cache is not None and (stored is None or stored_as != key):
        cache.write(key, codes)
    model.quant, model.draft_quant = mode, drafts
    return total


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
    widths = [model.cfg.hidden_size] + [_weight_of(model, owner, attr)[0].shape[1]
                                        for name, (owner, attr) in targets(model).items()
                                        if name.startswith(DRAFTS)]
    return "int4" if all(native.group_for(w) for w in widths) else mode


def resolve(model: Transformer, mode: str) -> str:
    """The mode that runs when `mode` is asked for."""
    return choose(model) if mode == "auto" else mode


def choose(model: Transformer) -> str:
    """What `auto` runs (see AUTO_BYTES)."""
    return auto_mode(model.model.embed_tokens.weight.device.type, matmul_bytes(model))


def auto_mode(device_type: str, nbytes: int) -> str:
    """What `auto` runs on a device of this type for `nbytes` of matmul weights as loaded."""
    return "int8" if device_type == "cpu" and nbytes >= AUTO_BYTES and native.available() \
        else "none"


def matmul_bytes(model: Transformer) -> int:
    """Bytes the weights of every quantization target take as loaded."""
    return sum(w.numel() * w.element_size()
               for owner, attr in targets(model).values()
               for w in [_weight_of(model, owner, attr)[0]])


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
        return f"{mode} (vnni kernels{drafts}){auto}"
    why = native.status() if mode in ("int4", "int8") and \
        model.model.embed_tokens.weight.device.type == "cpu" else ""
    return f"{mode} (torch kernels{': ' + why if why != 'vnni' and why else ''}){auto}"


def _weight_of(model: Transformer, owner: nn.Module, attr: str) -> tuple[Tensor, Tensor | None]:
    if attr == "head_weight":
        w = model.model.embed_tokens.weight if model.cfg.tie_word_embeddings \
            else model.lm_head.weight
        return w.detach(), None
    target = getattr(owner, attr)
    bias = getattr(target, "bias", None)
    return target.weight.detach(), None if bias is None else bias.detach()


def _install(model: Transformer, owner: nn.Module, attr: str, packed: Packed) -> None:
    """Put `packed` in place and drop the full-precision weight it replaces (the embedding a
    tied head shares stays: the lookup needs it)."""
    if attr == "head_weight":
        model.head_weight = packed
        if not model.cfg.tie_word_embeddings:
            model.lm_head.weight.data = torch.empty(0, device=packed.codes.device)
    elif attr == "fused":
        setattr(owner, attr, packed)
        for child in getattr(owner, "FUSED", ()):  # views into the fused weight
            getattr(owner, child).weight.data = torch.empty(0, device=packed.codes.device)
    else:
        setattr(owner, attr, QuantLinear(packed))


class QuantCache:
    """Codes of one checkpoint's quantized weights on disk (see the module's docstring)."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        identity = checkpoint_identity(model_dir)
        self.key = hashlib.sha256(identity.encode()).hexdigest()[:24]
        self.root = root

    def path(self, mode: str) -> Path:
        return self.root / f"{self.key}-{mode}-g{GROUP}.safetensors"

    def read(self, mode: str) -> dict[str, tuple[Tensor, Tensor, int]] | None:
        path = self.path(mode)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                groups = json.loads((f.metadata() or {}).get("groups", "{}"))
                return {name: (f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales"),
                               int(groups[name])) for name in groups}
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            return None  # unreadable or partial: computed again, and written anew

    def write(self, mode: str, codes: dict[str, tuple[Tensor, Tensor, int]]) -> None:
        tensors = {}
        for name, (c, s, _) in codes.items():
            tensors[f"{name}.codes"] = c.contiguous().cpu()
            tensors[f"{name}.scales"] = s.contiguous().cpu()
        groups = json.dumps({name: g for name, (_, _, g) in codes.items()})
        write_replacing(self.path(mode),
                        lambda tmp: save_file(tensors, str(tmp), metadata={"groups": groups}))

