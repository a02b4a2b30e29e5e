"""Checkpoints written by `save_model` load back equal; bad checkpoints fail with a clear error.

Every MTP naming round-trips tensor for tensor, under the names its family uses. Broken
checkpoints (missing, unexpected, mis-shaped tensors, truncated or foreign files, broken
indexes and configs) raise `CheckpointError` / `ConfigError` naming the file and the tensor
or key, and never another exception type.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.model.config import ConfigError, ModelConfig
from engine.model.presets import PRESETS
from engine.model.transformer import Transformer
from engine.model.weights import (
    CheckpointError,
    detect_mtp_naming,
    load_model,
    save_model,
    to_checkpoint_name,
)

SMALL = {"vocab_size": 128, "intermediate_size": 96, "max_position_embeddings": 256}
CONFIGS = {
    "deepseek": PRESETS["tiny-llama"].with_(**SMALL),
    "deepseek-2": PRESETS["tiny-qwen3"].with_(**SMALL),  # 3 layers, 2 modules
    "mimo": PRESETS["tiny-qwen2"].with_(family="mimo", mtp_naming="mimo", **SMALL),
    "mimo-as-qwen2": PRESETS["tiny-qwen2"].with_(mtp_naming="mimo", **SMALL),
    "mtp": PRESETS["tiny-qwen3"].with_(mtp_naming="mtp", num_mtp_modules=1,
                                       mtp_layers_per_module=2, **SMALL),
}
# The names each family's checkpoints use for the MTP parts (with L trunk layers).
EXPECTED_NAMES = {
    "deepseek": [f"model.layers.2.{n}" for n in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.o_proj.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight")],
    "deepseek-2": [f"model.layers.{3 + i}.{n}" for i in range(2) for n in (
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "self_attn.q_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")],
    "mimo": [f"model.mtp_layers.0.{n}" for n in (
        "token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
        "final_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
        "mlp.up_proj.weight")],
    "mtp": ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.self_attn.k_norm.weight", "mtp.layers.1.mlp.down_proj.weight",
            "mtp.layers.1.input_layernorm.weight"],
}
EXPECTED_NAMES["mimo-as-qwen2"] = EXPECTED_NAMES["mimo"]


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norms start at one: make every tensor distinct
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _names(model_dir: Path) -> dict[str, str]:
    """Tensor name -> dtype string, over every safetensors file in the directory."""
    out: dict[str, str] = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st_file:
            out.update({n: st_file.get_slice(n).get_dtype() for n in st_file.keys()})  # noqa: SIM118
    return out


def _assert_same_tensors(a: Transformer, b: Transformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def _assert_same_outputs(a: Transformer, b: Transformer) -> None:
    tokens = torch.randint(0, a.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (la, ma), (lb, mb) = a(tokens), b(tokens)
    assert torch.equal(la, lb)
    assert len(ma) == len(mb) == a.cfg.num_mtp_modules
    assert all(torch.equal(x, y) for x, y in zip(ma, mb, strict=True))


@pytest.mark.parametrize("case", CONFIGS)
def test_roundtrip_each_naming(case: str, tmp_path: Path) -> None:
    cfg = CONFIGS[case]
    model = _model(cfg)
    save_model(model, tmp_path)
    names = _names(tmp_path)
    assert set(names) == {to_checkpoint_name(n, cfg) for n in model.state_dict()}
    assert len(names) == len(model.state_dict())  # no two parameters share a name
    assert set(EXPECTED_NAMES[case]) <= set(names)
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(names)
    assert ("lm_head.weight" in names) != cfg.tie_word_embeddings
    loaded = load_model(tmp_path)
    assert loaded.cfg == cfg
    _assert_same_tensors(model, loaded)
    _assert_same_outputs(model, loaded)  # also catches a naming read back as another


@pytest.mark.parametrize("case", CONFIGS)
def test_config_key_for_the_naming(case: str, tmp_path: Path) -> None:
    cfg = CONFIGS[case]
    save_model(_model(cfg), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == cfg.family
    if cfg.mtp_naming == "mtp":
        assert raw["mtp_num_hidden_layers"] == cfg.mtp_layers_per_module
        assert "num_nextn_predict_layers" not in raw
    else:
        assert raw["num_nextn_predict_layers"] == cfg.num_mtp_modules
        assert "mtp_num_hidden_layers" not in raw


def test_detect_mtp_naming() -> None:
    cfg = CONFIGS["deepseek"]
    assert detect_mtp_naming(["model.layers.1.mlp.up_proj.weight"], cfg) is None
    assert detect_mtp_naming(["model.layers.2.enorm.weight"], cfg) == "deepseek"
    assert detect_mtp_naming(["model.mtp_layers.0.input_proj.weight"], cfg) == "mimo"
    assert detect_mtp_naming(["mtp.fc.weight"], cfg) == "mtp"


def test_no_mtp_modules_roundtrip(tmp_path: Path) -> None:
    cfg = CONFIGS["deepseek"].with_(num_mtp_modules=0)
    model = _model(cfg)
    save_model(model, tmp_path)
    assert not any(n.startswith("model.layers.2.") for n in _names(tmp_path))
    _assert_same_tensors(model, load_model(tmp_path))


def test_several_blocks_per_module_need_the_mtp_naming() -> None:
    with pytest.raises(ConfigError, match="one block per MTP module"):
        CONFIGS["deepseek"].with_(mtp_layers_per_module=2)


def test_deepseek_shared_copies_are_ignored(tmp_path: Path) -> None:
    """DeepSeek-V3 stores a copy of the embedding and the head in every MTP layer."""
    cfg = CONFIGS["deepseek-2"]
    model = _model(cfg)
    save_model(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for i in range(cfg.num_mtp_modules):
        prefix = f"model.layers.{cfg.num_layers + i}."
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path)
    loaded = load_model(tmp_path)
    _assert_same_tensors(model, loaded)
    _assert_same_outputs(model, loaded)


@pytest.mark.parametrize("case", ["deepseek", "mimo", "mtp"])
def test_sharded_roundtrip(case: str, tmp_path: Path) -> None:
    model = _model(CONFIGS[case])
    save_model(model, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert set(index["weight_map"]) == set(_names(tmp_path))
    _assert_same_tensors(model, load_model(tmp_path))


DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@pytest.mark.parametrize("saved", DTYPES, ids=str)
@pytest.mark.parametrize("loaded", DTYPES, ids=str)
def test_dtypes(saved: torch.dtype, loaded: torch.dtype, tmp_path: Path) -> None:
    model = _model(CONFIGS["deepseek"])
    save_model(model, tmp_path, dtype=saved)
    assert set(_names(tmp_path).values()) == {DTYPES[saved]}
    back = load_model(tmp_path, dtype=loaded)
    state = back.state_dict()
    for name, t in model.state_dict().items():
        assert state[name].dtype == loaded, name
        assert torch.equal(state[name], t.to(saved).to(loaded)), name
    assert back(torch.tensor([[1, 2, 3]]))[0].dtype == loaded


# --- broken checkpoints -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good")
    save_model(_model(CONFIGS["deepseek"]), path)
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sharded")
    save_model(_model(CONFIGS["deepseek"]), path, max_shard_bytes=40_000)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


def _load_error(path: Path, kind: type[Exception] = CheckpointError) -> str:
    with pytest.raises(kind) as info:
        load_model(path)
    return str(info.value)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight",
                                  "model.layers.2.enorm.weight", "model.norm.weight",
                                  "lm_head.weight"])
def test_missing_tensor(name: str, good_dir: Path, tmp_path: Path) -> None:
    path = _copy(good_dir, tmp_path)
    _edit_tensors(path / "model.safetensors", lambda t: t.pop(name))
    msg = _load_error(path)
    assert str(path) in msg and repr(name) in msg and "missing" in msg


@pytest.mark.parametrize("name", ["model.layers.0.mlp.extra.weight", "model.layers.3.enorm.weight",
                                  "mtp_head.weight"])
def test_unexpected_tensor(name: str, good_dir: Path, tmp_path: Path) -> None:
    path = _copy(good_dir, tmp_path)
    _edit_tensors(path / "model.safetensors", lambda t: t.update({name: torch.zeros(3)}))
    msg = _load_error(path)
    assert str(path / "model.safetensors") in msg and repr(name) in msg and "unexpected" in msg


def test_misshaped_tensor(good_dir: Path, tmp_path: Path) -> None:
    path = _copy(good_dir, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_tensors(path / "model.safetensors", lambda t: t.update({name: t[name].T.contiguous()}))
    msg = _load_error(path)
    assert str(path / "model.safetensors") in msg and repr(name) in msg
    assert "[64, 32]" in msg and "[32, 64]" in msg


def _last_tensor(path: Path) -> str:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + n])
    header.pop("__metadata__", None)
    return max(header, key=lambda k: header[k]["data_offsets"][1])


def test_truncated_file_names_the_tensor(good_dir: Path, tmp_path: Path) -> None:
    path = _copy(good_dir, tmp_path) / "model.safetensors"
    last = _last_tensor(path)
    path.write_bytes(path.read_bytes()[:-10])
    msg = _load_error(path.parent)
    assert str(path) in msg and "truncated" in msg and repr(last) in msg


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_anywhere(fraction: float, good_dir: Path,
                            tmp_path_factory: pytest.TempPathFactory) -> None:
    path = _copy(good_dir, tmp_path_factory.mktemp("trunc")) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:int(fraction * len(data))])
    assert str(path) in _load_error(path.parent)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=64))
def test_not_safetensors_at_all(data: bytes, good_dir: Path,
                                tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("junk")
    shutil.copy(good_dir / "config.json", path)
    (path / "model.safetensors").write_bytes(data)
    _load_error(path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "I8"]) | JSON,
    "shape": st.lists(st.integers(-1, 4), max_size=2) | JSON,
    "data_offsets": st.lists(st.integers(-1, 64), max_size=3) | JSON,
})


@settings(max_examples=60, deadline=None)
@given(header=JSON | st.dictionaries(st.sampled_from(["model.norm.weight", "x", "__metadata__"]),
                                     ENTRY | JSON, max_size=3),
       tail=st.binary(max_size=16))
def test_malformed_header(header: Any, tail: bytes, good_dir: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Well-framed files whose JSON header is anything at all: always a CheckpointError."""
    path = tmp_path_factory.mktemp("header")
    shutil.copy(good_dir / "config.json", path)
    text = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + tail)
    assert str(path) in _load_error(path)  # the file, or the directory for a missing tensor


def test_text_file_as_weights(good_dir: Path, tmp_path: Path) -> None:
    shutil.copy(good_dir / "config.json", tmp_path)
    (tmp_path / "model.safetensors").write_text("this is not a checkpoint\n")
    msg = _load_error(tmp_path)
    assert str(tmp_path / "model.safetensors") in msg and "not a safetensors file" in msg


def test_index_points_to_missing_shard(sharded_dir: Path, tmp_path: Path) -> None:
    path = _copy(sharded_dir, tmp_path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[1]
    (path / shard).unlink()
    msg = _load_error(path)
    held = [n for n, f in weight_map.items() if f == shard]
    assert str(path / shard) in msg and "missing" in msg and any(repr(n) in msg for n in held)


def test_index_points_to_wrong_shard(sharded_dir: Path, tmp_path: Path) -> None:
    path = _copy(sharded_dir, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values()))
                 if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _load_error(path)
    assert str(path / wrong) in msg and repr(name) in msg


@pytest.mark.parametrize("text", ["{not json", "[]", '{"weight_map": [1, 2]}',
                                  '{"weight_map": {"model.norm.weight": 3}}', '{"metadata": {}}'])
def test_broken_index(text: str, sharded_dir: Path, tmp_path: Path) -> None:
    path = _copy(sharded_dir, tmp_path)
    (path / "model.safetensors.index.json").write_text(text)
    assert str(path / "model.safetensors.index.json") in _load_error(path)


@pytest.mark.parametrize(("edit", "words"), [
    (lambda raw: raw.update(model_type="gpt2"), ["model_type", "'gpt2'"]),
    (lambda raw: raw.pop("model_type"), ["model_type", "None"]),
    (lambda raw: raw.pop("hidden_size"), ["missing", "'hidden_size'"]),
    (lambda raw: raw.pop("num_attention_heads"), ["missing", "'num_attention_heads'"]),
    (lambda raw: raw.update(num_key_value_heads=3), ["num_attention_heads (4)",
                                                     "num_key_value_heads (3)"]),
    (lambda raw: raw.update(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (lambda raw: raw.update(vocab_size="many"), ["bad value"]),
    (lambda raw: raw.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     ["'dynamic'"]),
], ids=["model_type", "no-model_type", "no-hidden_size", "no-heads", "kv-heads", "act",
        "vocab", "rope"])
def test_bad_config(edit: Callable[[dict[str, Any]], None], words: list[str], good_dir: Path,
                    tmp_path: Path) -> None:
    path = _copy(good_dir, tmp_path)
    _edit_config(path, edit)
    msg = _load_error(path, ConfigError)
    assert str(path / "config.json") in msg
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "", "\xff"])
def test_config_not_json(text: str, good_dir: Path, tmp_path: Path) -> None:
    path = _copy(good_dir, tmp_path)
    (path / "config.json").write_text(text, encoding="latin-1")
    assert str(path / "config.json") in _load_error(path, ConfigError)


def test_missing_config(good_dir: Path, tmp_path: Path) -> None:
    shutil.copy(good_dir / "model.safetensors", tmp_path)
    assert str(tmp_path / "config.json") in _load_error(tmp_path, ConfigError)


def test_dir_without_weights(good_dir: Path, tmp_path: Path) -> None:
    shutil.copy(good_dir / "config.json", tmp_path)
    assert str(tmp_path) in _load_error(tmp_path)


def test_not_a_directory(tmp_path: Path) -> None:
    assert str(tmp_path / "nope") in _load_error(tmp_path / "nope")


VALID_RAW = CONFIGS["deepseek"].to_hf()
CONFIG_KEYS = [*sorted(VALID_RAW), "rope_parameters", "rope_scaling",
               "original_max_position_embeddings", "mtp_num_hidden_layers"]


@settings(max_examples=150, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON, max_size=3))
def test_config_parser_only_raises_config_error(changes: dict[str, Any]) -> None:
    try:
        cfg = ModelConfig.from_hf({**VALID_RAW, **changes})
    except ConfigError:
        return
    assert isinstance(cfg, ModelConfig)
