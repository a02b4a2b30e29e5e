"""Checkpoint loading and saving: safetensors (single or sharded), HF names, three MTP namings;
and Gemma 4's assistant drafters (engine/model/assistant.py), checked against their target.

Every tensor name is validated against the model before a byte is loaded, so a bad checkpoint
fails with the file and tensor named and nothing half-loaded ever reaches the caller.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model.assistant import Assistant, AssistantConfig
from engine.model.config import ConfigError, ModelConfig
from engine.model.quant import MODES, resolve, run_dtype, targets
from engine.model.transformer import Transformer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, naming the file and tensor at fault."""


# Per-module parameter names that differ between namings: ours -> theirs.
_MODULE_NAMES = {
    "deepseek": {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                 "norm": "shared_head.norm"},
    "mimo": {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
             "norm": "final_layernorm"},
    "mtp": {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
            "norm": "norm"},
}
# MTP modules trained for a model that had none (`ahead train --heads-only`), kept beside it.
HEADS_FILE = "mtp-heads.safetensors"
# Copies of the shared embedding and head that some DeepSeek-style checkpoints store per module.
_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _module_prefix(naming: str, cfg: ModelConfig, i: int) -> str:
    if naming == "deepseek":
        return f"model.layers.{cfg.num_layers + i}."
    if naming == "mimo":
        return f"model.mtp_layers.{i}."
    return "mtp."


def to_checkpoint_name(name: str, cfg: ModelConfig) -> str:
    """Our parameter name -> the checkpoint's, for the config's MTP naming."""
    m = re.match(r"mtp\.(\d+)\.(.+)", name)
    if not m:
        return name
    i, rest = int(m.group(1)), m.group(2)
    naming = cfg.mtp_naming
    prefix = _module_prefix(naming, cfg, i)
    if rest.startswith("blocks."):
        j, tail = rest[len("blocks."):].split(".", 1)
        return prefix + (f"layers.{j}.{tail}" if naming == "mtp" else tail)
    part, leaf = rest.rsplit(".", 1)
    return f"{prefix}{_MODULE_NAMES[naming][part]}.{leaf}"


def detect_mtp_naming(names: Iterable[str], cfg: ModelConfig) -> str | None:
    names = list(names)
    if any(n.startswith("model.mtp_layers.") for n in names):
        return "mimo"
    if any(n.startswith("mtp.") for n in names):
        return "mtp"
    extra = re.compile(r"model\.layers\.(\d+)\.")
    if any((m := extra.match(n)) and int(m.group(1)) >= cfg.num_layers for n in names):
        return "deepseek"
    return None


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from a sharded index or the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index: {e}") from None
        if not (isinstance(weight_map, dict)
                and all(isinstance(f, str) for f in weight_map.values())):
            raise CheckpointError(f"{index}: weight_map is not an object of tensor -> file name")
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(f for f in model_dir.glob("*.safetensors") if f.name != HEADS_FILE)
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, Path] = {}
    for f in files:  # several loose files (a heads-only file beside the trunk, say)
        out.update(dict.fromkeys(read_header(f), f))
    return out


def read_header(path: Path) -> dict[str, dict]:
    """The safetensors header, checked against the file's size (catches truncation)."""
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000:
                raise CheckpointError(f"{path}: header length {n} is not plausible")
            header = json.loads(fh.read(n))
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (OSError, struct.error, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file: the header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not _valid_entry(info):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry: "
                                  f"{info!r:.200}")
        end = 8 + n + info["data_offsets"][1]
        if end > size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {end}, "
                                  f"file has {size}")
    return header


def _valid_entry(info: object) -> bool:
    def ints(x: object) -> bool:
        return isinstance(x, list) and all(type(v) is int and v >= 0 for v in x)

    return (isinstance(info, dict) and isinstance(info.get("dtype"), str)
            and ints(info.get("shape"))
            and ints(info.get("data_offsets")) and len(info["data_offsets"]) == 2)


def load_model(model_dir: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32, heads: bool = True,
               mtp: bool = True, quant: str = "none") -> Transformer:
    """Build the model from config.json + safetensors, straight onto `device` in `dtype`
    (None: the mode's, `quant.run_dtype`).

    A heads file beside a checkpoint without MTP modules adds its modules (unless `heads`
    is False). `mtp` False: the trunk alone, the modules' tensors checked and not read.
    `quant`: the mode the model will be quantized in (`quantize_model`); the weights it
    replaces stay in their stored dtype where that is no wider than `dtype`, mapped from the
    file and unread until encoded (never, where codes on disk replace them)."""
    model, expected, files = check_checkpoint(model_dir, heads=heads)
    if not mtp and model.num_mtp:
        with torch.device("meta"):
            model = Transformer(model.cfg.with_(num_mtp_modules=0))
        own = set(model.state_dict())
        expected = {k: v for k, v in expected.items() if v[0] in own}
    device = torch.device(device)
    mode = resolve(model, quant, device.type)
    state = _read_tensors(expected, files, device, dtype or run_dtype(device.type, mode),
                          replaced_weights(model, mode))
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def replaced_weights(model: Transformer, mode: str) -> set[str]:
    """The parameters (state_dict names) whose weights `quantize_model` in `mode` (resolved)
    replaces with codes: every target's but the embedding a tied head shares (the lookup
    keeps it). `load_model` reads these as stored where that is no wider than the run dtype:
    a weight the codes replace is never widened (a 2B model loaded in fp32 from bf16 peaked
    at 11.7 GB, and spent 21 s casting)."""
    if mode not in MODES or mode in ("none", "auto"):  # (quantize_model says what is wrong)
        return set()
    out: set[str] = set()
    for name, (owner, attr) in targets(model).items():  # by module path; the heads by role
        if attr == "head_weight":
            if not model.cfg.tie_word_embeddings:
                out.add("lm_head.weight")
        elif attr == "fused":  # fused already: its parts are what a checkpoint holds
            module = name.removesuffix("fused")
            out |= {f"{module}{part}.weight" for part in getattr(owner, "FUSED", ())}
        elif attr != "rows":  # the draft head's rows are made from the head, not loaded
            out.add(f"{name}.weight")
    return out


Expected = dict[str, tuple[str, tuple[int, ...]]]  # stored name -> (our name, shape)


def check_checkpoint(model_dir: str | Path, *,
                     heads: bool = True) -> tuple[Transformer, Expected, dict[str, Path]]:
    """What `load_model` checks before it reads a tensor: the config, the files' headers and
    every tensor's name; the model on the meta device, the tensors it expects and their
    files. Raises ConfigError or CheckpointError with the reason."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    cfg = ModelConfig.from_file(model_dir / "config.json")
    files = checkpoint_files(model_dir)
    naming = detect_mtp_naming(files, cfg)
    if naming is not None:
        cfg = cfg.with_(mtp_naming=naming)
    if heads and (model_dir / HEADS_FILE).exists():
        cfg = _add_heads(model_dir / HEADS_FILE, cfg, files)
    with torch.device("meta"):
        model = Transformer(cfg)
    files, stored = _wrapper_names(files)
    expected = {stored(to_checkpoint_name(n, cfg)): (n, tuple(p.shape))
                for n, p in model.state_dict().items()}
    ignorable = {stored(n) for n in _unused(cfg)} | \
        ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    _check_names(expected, files, model_dir,
                 lambda n: n in ignorable or n.endswith("rotary_emb.inv_freq") or
                 (cfg.mtp_naming == "deepseek" and n.endswith(_SHARED_COPIES)))
    return model, expected, files


# The multimodal Qwen3.5 and Gemma 4 wrappers: the text model under model.language_model.,
# beside vision (and audio) towers that ahead does not run (their tensors are known, and
# skipped).
_LANGUAGE = "model.language_model."
_TOWERS = ("model.visual.", "model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
           "model.embed_audio.")


def _wrapper_names(files: dict[str, Path]) -> tuple[dict[str, Path], Callable[[str], str]]:
    """The tensors to load and how our checkpoint names map to the stored ones."""
    if not any(n.startswith(_LANGUAGE) for n in files):
        return files, lambda name: name
    text = {n: f for n, f in files.items() if not n.startswith(_TOWERS)}
    return text, lambda name: _LANGUAGE + name[len("model."):] if name.startswith("model.") \
        else name


def _unused(cfg: ModelConfig) -> set[str]:
    """Tensors a checkpoint may hold that the model does not use: Gemma 4's KV-shared
    layers' own key and value weights (they attend over an earlier layer's; transformers
    ignores them too)."""
    return {f"model.layers.{i}.self_attn.{part}.weight"
            for i, source in enumerate(cfg.kv_sources) if source != i
            for part in ("k_proj", "v_proj", "k_norm", "v_norm")} | \
        {f"model.layers.{i}.self_attn.{part}.bias" for i, source in enumerate(cfg.kv_sources)
         if source != i for part in ("k_proj", "v_proj")}


def _add_heads(path: Path, cfg: ModelConfig, files: dict[str, Path]) -> ModelConfig:
    if cfg.num_mtp_modules:
        raise CheckpointError(f"{path}: the checkpoint has MTP modules of its own; "
                              "remove one of the two")
    names = read_header(path)
    try:
        with safe_open(str(path), framework="pt") as st:
            meta = st.metadata() or {}
        cfg = cfg.with_(num_mtp_modules=int(meta["num_mtp_modules"]),
                        mtp_naming=meta["mtp_naming"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: not a heads file (metadata {e})") from None
    files.update(dict.fromkeys(names, path))
    return cfg


def _check_names(expected: Expected, files: dict[str, Path], model_dir: Path,
                 ignorable: Callable[[str], bool]) -> None:
    """Every tensor expected is in its file with its shape, and every other one stored is
    `ignorable`; else CheckpointError naming the file and tensor."""
    unexpected = [n for n in files if n not in expected and not ignorable(n)]
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected tensors "
                              f"{', '.join(map(repr, unexpected[:8]))}" + _more(unexpected, 8))
    missing = [n for n in expected if n not in files]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor {missing[0]!r}" + _more(missing))
    headers: dict[Path, dict[str, dict]] = {}
    for name, (_, shape) in expected.items():
        f = files[name]
        if f not in headers:
            if not f.is_file():
                raise CheckpointError(f"{f}: file is missing (it should hold {name!r})")
            headers[f] = read_header(f)
        if name not in headers[f]:
            raise CheckpointError(f"{f}: tensor {name!r} is listed in the index "
                                  "but not in the file")
        got = tuple(headers[f][name]["shape"])
        if got != shape:
            raise CheckpointError(f"{f}: tensor {name!r} has shape {list(got)}, "
                                  f"expected {list(shape)}")


def _more(names: list[str], shown: int = 1) -> str:
    return f" (and {len(names) - shown} more)" if len(names) > shown else ""


def _read_tensors(expected: Expected, files: dict[str, Path], device: torch.device,
                  dtype: torch.dtype, stored: frozenset[str] | set[str] = frozenset()
                  ) -> dict[str, torch.Tensor]:
    """The expected tensors by our names, floating ones in `dtype` but those named in
    `stored`, which are never widened: kept as stored where that is no wider (an fp32 one
    kept for a bf16 run would take twice the memory on a GPU until encoded), others as
    stored (an assistant's token ordering)."""
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as st:
                for name in names:
                    t = st.get_tensor(name)
                    ours = expected[name][0]
                    kept = ours in stored and t.element_size() <= dtype.itemsize
                    state[ours] = t.to(dtype) if t.is_floating_point() and not kept else t
        except Exception as e:  # safetensors raises its own error types; name the file
            raise CheckpointError(f"{f}: cannot read tensors: {e}") from None
    return state


def save_model(model: Transformer, model_dir: str | Path, *, max_shard_bytes: int | None = None,
               dtype: torch.dtype | None = None) -> None:
    """Write config.json and safetensors in HF layout (sharded with an index if asked)."""
    if model.quant != "none":
        raise CheckpointError(f"a {model.quant}-quantized model has dropped its full-precision "
                              "weights: save the checkpoint it was loaded from instead")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    tensors = {to_checkpoint_name(n, cfg): t.detach().to(dtype or t.dtype).contiguous().cpu()
               for n, t in model.state_dict().items()
               if not n.startswith("assistant.")}  # a drafter of its own checkpoint
    if max_shard_bytes is None:
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total},
             "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_assistant(path: str | Path, target: ModelConfig, *,
                   device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> Assistant:
    """An assistant checkpoint (config.json + safetensors) for `target`, straight onto
    `device`: floating tensors in `dtype`, the token ordering as stored. Raises ConfigError
    (it does not fit the target) or CheckpointError (names the file and tensor)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    cfg = AssistantConfig.from_file(path / "config.json")
    try:
        cfg.check_target(target)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    with torch.device("meta"):
        assistant = Assistant(cfg, target)
    expected = {n: (n, tuple(t.shape)) for n, t in assistant.state_dict().items()}
    files = checkpoint_files(path)
    tied = cfg.tie_word_embeddings
    _check_names(expected, files, path, lambda n: (tied and n == "lm_head.weight") or
                 n.endswith(("rotary_emb.inv_freq", "_inv_freq")))
    state = _read_tensors(expected, files, torch.device(device), dtype)
    assistant.load_state_dict(state, assign=True, strict=True)
    return assistant.eval()
