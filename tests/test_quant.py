"""Quantized matmuls (engine/model/quant.py): int8 and int4 weights, and int8 weights with int8
activations (int8dyn): codes within half a step of the weights,
torch's kernels multiplying by exactly what the codes stand for, every matmul of trunk,
modules and head quantized, the decoding contract kept in the quantized model, and codes
read back from the disk cache instead of computed (a changed checkpoint gets new ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import Engine, GenParams
from engine.model.codes import Packed, QuantError, decode, encode
from engine.model.quant import (
    MODES,
    QuantCache,
    matmul_params,
    packed_weights,
    quantize_model,
    targets,
)
from engine.model.weights import CheckpointError, load_model, save_model
from tests.conftest import load_exact
from tests.test_identity import run_batched
from tests.test_native import needs_vnni
from training.synthetic import write_checkpoint

QUANTS = [m for m in MODES if m not in ("none", "auto")]


@pytest.mark.parametrize("mode", QUANTS)
@pytest.mark.parametrize("shape", [(200, 64), (384, 256), (48, 96)])
def test_codes_are_within_half_a_step_and_the_kernel_multiplies_by_them(
        mode: str, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * 0.02
    codes, scales, group = encode(w, mode)
    back = decode(codes, scales, mode, group)
    if mode != "int4":
        step = w.abs().amax(1, keepdim=True) / 127
    else:
        g = w.view(shape[0], -1, group)
        step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).repeat_interleave(
            group, dim=1).view(shape)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    bias = torch.randn(shape[0], generator=gen)
    x = torch.randn(3, 5, shape[1], generator=gen)
    got = Packed(mode, codes, scales, bias, group)(x)
    # activations in bf16 (int8dyn: int8 per row), as the kernels take them
    want = F.linear(x.bfloat16().float(), back, bias)
    assert got.shape == (3, 5, shape[0]) and got.dtype == x.dtype
    assert torch.allclose(got, want, atol=2e-2 * want.abs().max().item())


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quant-qwen35")
    write_checkpoint(path, "tiny-qwen3.5", train_steps=20, seed=0, mtp_naming="mtp")
    return path


@pytest.mark.parametrize("mode", QUANTS)
def test_every_matmul_is_quantized_and_the_logits_stay_close(hybrid_dir: Path,
                                                            mode: str) -> None:
    model = load_model(hybrid_dir)
    model.fuse()
    names = set(targets(model))
    tokens = torch.randint(300, 396, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref, ref_mtp = model(tokens)
    quantize_model(model, mode)
    assert set(packed_weights(model)) == names and model.quant == mode
    # trunk (attention, Gated DeltaNet, MLP), module and head
    assert {"head", "mtp.0.eh_proj", "model.layers.0.linear_attn.fused",
            "model.layers.3.self_attn.fused", "model.layers.3.mlp.down_proj"} <= names
    with torch.inference_mode():
        out, out_mtp = model(tokens)
    # The trained chain: the greedy next token mostly unchanged.
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert (out_mtp[0].argmax(-1) == ref_mtp[0].argmax(-1)).float().mean() > 0.8
    with pytest.raises(CheckpointError, match="quantized"):
        save_model(model, hybrid_dir / "nope")


def test_an_unknown_mode_is_refused(hybrid_dir: Path) -> None:
    with pytest.raises(QuantError, match="none, int8, int4, int8dyn, not 'int3'"):
        quantize_model(load_model(hybrid_dir), "int3")


@pytest.mark.parametrize("mode", QUANTS)
def test_quantized_speculative_output_is_its_plain_decoding(hybrid_dir: Path, tmp_path: Path,
                                                            mode: str) -> None:
    engine = load_exact(hybrid_dir, dtype=torch.bfloat16, max_seq_len=256, k_max=4, slots=3,
                        quant=mode, quant_cache=tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(300, 396, (n,), generator=gen).tolist() for n in (9, 70, 23)]
    plain = [engine.generate(p, GenParams(30, speculative=False, stop_loops=False),
                             slot="alone").tokens for p in prompts]
    for k in (1, 4, None):
        assert engine.generate(prompts[0], GenParams(30, k=k, stop_loops=False)).tokens \
            == plain[0], f"k={k}"
    params = [GenParams(30, k=k, speculative=k != 0, stop_loops=False) for k in (4, 0, None)]
    assert run_batched(engine, prompts, params) == plain


def _head_out(engine: Engine) -> torch.Tensor:
    x = torch.randn(2, engine.model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    return engine.model.head(x)


def _rewrite(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """The cache file at `path` with its tensors changed by `change`, metadata kept."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)


def test_codes_come_back_from_the_cache_and_a_changed_checkpoint_gets_new_ones(
        tmp_path: Path) -> None:
    """A second load multiplies by what the cache file holds (our kernels' layout where they
    run, else codes), and reads no weight the cache replaces; a changed checkpoint gets
    codes of its own."""
    from engine import native

    model_dir = tmp_path / "model"
    write_checkpoint(model_dir, "tiny-qwen3", seed=4)
    cache_root = tmp_path / "cache"
    first = Engine.load(model_dir, quant="int4", quant_cache=cache_root, max_seq_len=128)
    cache = QuantCache(cache_root, model_dir)
    laid_out = native.available()
    path = cache.path("int4", laid_out)
    assert path.is_file() and len(list(cache_root.iterdir())) == 1
    # Change the stored head: a load that reads the cache multiplies by it.
    part = "head.layout" if laid_out else "head.codes"

    def zero_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors[part] = torch.zeros_like(tensors[part])

    _rewrite(path, zero_head)
    second = Engine.load(model_dir, quant="int4", quant_cache=cache_root, max_seq_len=128)
    want = cache.read(path, "int4")["head"].packed(None, torch.device("cpu"))  # type: ignore[index]
    x = torch.randn(2, first.model.cfg.hidden_size)
    assert torch.equal(second.model.head(x), want(x))
    assert not torch.equal(second.model.head(x), first.model.head(x))
    # A checkpoint whose files changed is another checkpoint: its codes are computed anew,
    # and the file of the directory's old checkpoint goes; another checkpoint's stays.
    other_dir = tmp_path / "other"
    write_checkpoint(other_dir, "tiny-qwen3", seed=5)
    Engine.load(other_dir, quant="int4", quant_cache=cache_root, max_seq_len=128)
    other = QuantCache(cache_root, other_dir).path("int4", laid_out)
    weights = model_dir / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    third = Engine.load(model_dir, quant="int4", quant_cache=cache_root, max_seq_len=128)
    assert torch.equal(third.model.head(x), first.model.head(x))
    now = QuantCache(cache_root, model_dir).path("int4", laid_out)
    assert now != path and sorted(cache_root.iterdir()) == sorted([now, other])


@needs_vnni
def test_a_warm_load_maps_the_kernels_layout_and_reads_no_weight_it_replaces(
        hybrid_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where our kernels run, the cache holds their layout (a file of another layout version
    is removed when it is written): a second load packs nothing, encodes nothing and asks for
    no full-precision weight (the fused projections' are never made), its weights start on
    64-byte lines, and its steps give the first load's tokens."""
    from engine import native
    from engine.native import layout

    kw = {"quant": "int4", "quant_cache": tmp_path, "max_seq_len": 128, "draft_vocab": 64}
    path = QuantCache(tmp_path, hybrid_dir).path("int4", laid_out=True)
    older = path.with_name(path.name.replace(f"-wq{native.LAYOUT}.", "-wq0."))
    tmp_path.mkdir(exist_ok=True)
    older.write_bytes(b"a layout of another version")
    first = Engine.load(hybrid_dir, **kw)  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the other version removed

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("packed again")

    monkeypatch.setattr(layout, "pack", refused)
    monkeypatch.setattr("engine.native.pack", refused)
    monkeypatch.setattr("engine.model.quant.encode", refused)  # as quantize_model calls it
    from engine.model import quant

    made = quant._weight_of

    def shape_only(model: object, owner: object, attr: str, make: bool = True) -> object:
        assert not make, f"the full-precision weight of {attr} asked for"
        return made(model, owner, attr, make)  # type: ignore[arg-type]

    monkeypatch.setattr(quant, "_weight_of", shape_only)
    again = Engine.load(hybrid_dir, **kw)  # type: ignore[arg-type]
    packed = packed_weights(again.model)
    assert packed and all(p.native for p in packed.values()) and "draft_head" in packed
    assert all(p.packed.data_ptr() % 64 == 0 for p in packed.values())  # as the kernels like
    prompt = torch.randint(300, 396, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert again.generate(prompt, GenParams(16, stop_loops=False)).tokens == \
        first.generate(prompt, GenParams(16, stop_loops=False)).tokens


@pytest.mark.parametrize("mode", ["int4", "int8", "auto"])
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_the_weights_codes_replace_are_loaded_as_stored_and_give_the_same_codes(
        hybrid_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
        stored: torch.dtype) -> None:
    """A half-precision checkpoint run in fp32 and quantized: the weights the codes replace
    stay in their stored dtype (a 2B model cast to fp32 first peaked at 11.7 GB and spent
    21 s casting), everything else is fp32; `auto` decides as it would on fp32 weights, and
    the codes and tokens are those of the weights cast to fp32 first. Run in bf16, an fp32
    checkpoint's weights are cast as before: a weight is never held wider than the run's."""
    from engine.model import weights

    monkeypatch.setattr("engine.model.quant.AUTO_PARAMS", 1)  # auto: int8 where kernels run
    model_dir = tmp_path / "half"
    save_model(load_model(hybrid_dir), model_dir, dtype=stored)
    for f in hybrid_dir.glob("tokenizer*.json"):
        (model_dir / f.name).write_bytes(f.read_bytes())
    held = load_model(model_dir, quant=mode)
    cast = load_model(model_dir)  # quant "none": every floating tensor in fp32
    quantized = Engine.load(model_dir, quant=mode, quant_cache=tmp_path / "a",
                            max_seq_len=128, draft_vocab=64)
    linears = {f"{name}.weight" for name, m in held.named_modules()
               if isinstance(m, torch.nn.Linear)}
    if quantized.model.quant == "none":  # auto without our kernels: nothing is replaced
        linears = set()
    assert "model.layers.3.mlp.down_proj.weight" in linears or not linears
    for name, t in held.state_dict().items():
        if t.is_floating_point():
            assert t.dtype == (stored if name in linears else torch.float32), name
    assert matmul_params(held) == matmul_params(cast)  # what `auto` decides by
    monkeypatch.setattr(weights, "replaced_weights", lambda *args: set())  # cast first
    before = Engine.load(model_dir, quant=mode, quant_cache=tmp_path / "b", max_seq_len=128,
                         draft_vocab=64)
    got, want = packed_weights(quantized.model), packed_weights(before.model)
    assert set(got) == set(want) and quantized.model.quant == before.model.quant
    for name, p in got.items():
        assert torch.equal(p.packed, want[name].packed), name
        assert torch.equal(p.scales, want[name].scales), name
    prompt = torch.randint(300, 396, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert quantized.generate(prompt, GenParams(16, stop_loops=False)).tokens == \
        before.generate(prompt, GenParams(16, stop_loops=False)).tokens
    narrow = load_model(hybrid_dir, dtype=torch.bfloat16, quant=mode)  # stored in fp32
    assert all(t.dtype == torch.bfloat16 for t in narrow.state_dict().values()
               if t.is_floating_point())


@needs_vnni
def test_under_int8_the_drafts_run_in_int4_and_their_codes_come_back_from_the_cache(
        hybrid_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 where our kernels run: the trunk and the whole head in int8, the MTP module and
    the reduced draft head in int4 (drafts only propose: the output stays int8's, which
    `test_quantized_speculative_output_is_its_plain_decoding` holds); a second load reads
    every weight back from the cache file of that mix; an older cache of codes (of the whole
    model in int8, from before the drafts had their own mode) gives its trunk and head, and
    is replaced by the file in our kernels' layout."""
    from engine.model.quant import describe

    kw = {"quant": "int8", "max_seq_len": 128, "draft_vocab": 64}
    engine = Engine.load(hybrid_dir, quant_cache=tmp_path, **kw)  # type: ignore[arg-type]
    model = engine.model
    modes = {name: p.mode for name, p in packed_weights(model).items()}
    drafting = {"draft_head"} | {n for n in modes if n.startswith("mtp.")}
    assert {modes[n] for n in drafting} == {"int4"}
    assert {m for n, m in modes.items() if n not in drafting} == {"int8"}
    assert model.draft_head is not None and isinstance(model.draft_head.rows, Packed)
    assert model.draft_head.rows.mode == "int4" and describe(model).endswith("drafts int4)")
    cache = QuantCache(tmp_path, hybrid_dir)
    path = cache.path("int8-drafts-int4", laid_out=True)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    again = Engine.load(hybrid_dir, quant_cache=tmp_path, **kw)  # type: ignore[arg-type]
    stored = load_file(str(path))
    for name, p in packed_weights(again.model).items():
        assert torch.equal(p.packed, stored[f"{name}.layout"]), name
    prompt = torch.randint(300, 396, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert again.generate(prompt, GenParams(16, stop_loops=False)).tokens == \
        engine.generate(prompt, GenParams(16, stop_loops=False)).tokens
    # A cache of codes of the whole model in int8, as written before: its trunk and head
    # serve, the module and the draft head are made in int4, and the new file replaces it.
    older = tmp_path / "older"
    older_cache = QuantCache(older, hybrid_dir)
    whole = older_cache.path("int8")
    model = Engine.load(hybrid_dir, quant="none", max_seq_len=128).model
    codes = {name: encode(quant_weight(model, name), "int8") for name in targets(model)
             if name != "draft_head"}
    codes["head"] = (torch.zeros_like(codes["head"][0]), *codes["head"][1:])  # must be read
    tensors = {f"{n}.{part}": t for n, (c, s, _) in codes.items()
               for part, t in (("codes", c), ("scales", s))}
    older.mkdir()
    save_file(tensors, str(whole), metadata={"groups": json.dumps({n: g for n, (_, _, g)
                                                                   in codes.items()})})
    third = Engine.load(hybrid_dir, quant_cache=older, **kw)  # type: ignore[arg-type]
    packed = packed_weights(third.model)
    # zero codes, the old file's head: nothing but the kernel's rounding
    assert _head_out(third).abs().max() < 1e-4 * _head_out(engine).abs().max()
    assert {packed[n].mode for n in packed if n in drafting} == {"int4"}
    assert [p.name for p in older.iterdir()] == \
        [older_cache.path("int8-drafts-int4", laid_out=True).name]


def quant_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The full-precision weight of the target `name` of an unquantized engine's model."""
    from engine.model.quant import _weight_of

    owner, attr = targets(model)[name]  # type: ignore[arg-type]
    return _weight_of(model, owner, attr)  # type: ignore[arg-type]


def test_the_cli_runs_a_quantized_model_and_status_names_it(trained_dir: Path,
                                                            tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "clients.cli", "generate", "--model",
                           str(trained_dir), "def add(a, b):", "--max-tokens", "8",
                           "--no-daemon", "--raw", "--quant", "int8"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def add(a, b):")
    assert list((tmp_path / "ahead" / "quant").glob("*-int8-*.safetensors"))
    bad = subprocess.run([sys.executable, "-m", "clients.cli", "generate", "--model",
                          str(trained_dir), "x", "--no-daemon", "--quant", "int3"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "int3" in bad.stderr


def test_without_a_dtype_asked_for_our_kernels_quantized_models_run_in_bf16(
        hybrid_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No dtype asked for: a model our kernels multiply in int8 or int4 runs in bf16 where
    the CPU has AVX512-BF16 (Qwen2-1.5B's shapes in int4: a step 0.75x fp32's), `auto`'s
    choice included; one unquantized, or in torch's kernels, in fp32; on CUDA, bf16."""
    from engine import native
    from engine.model.quant import run_dtype

    ours = native.available() and native.kernels().bf16_dot
    kw = {"dtype": None, "max_seq_len": 128, "draft_vocab": 64}
    for quant, want in (("int4", ours), ("int8", ours), ("int8dyn", False), ("none", False),
                        ("auto", False)):
        engine = Engine.load(hybrid_dir, quant=quant, **kw)  # type: ignore[arg-type]
        assert engine.dtype == (torch.bfloat16 if want else torch.float32), quant
    monkeypatch.setattr("engine.model.quant.AUTO_PARAMS", 1)  # every model is large
    large = Engine.load(hybrid_dir, quant="auto", **kw)  # type: ignore[arg-type]
    assert large.dtype == (torch.bfloat16 if ours else torch.float32)
    assert large.model.quant == ("int8" if native.available() else "none")
    assert run_dtype("cuda", "none") == run_dtype("cuda", "int4") == torch.bfloat16


def test_auto_quantizes_a_large_model_where_the_kernels_run_and_leaves_a_small_one(
        hybrid_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import native
    from engine.model.quant import describe

    small = Engine.load(hybrid_dir, quant="auto")
    assert small.model.quant == "none" and describe(small.model) == "none (auto)"
    from engine.bundled import bundled_model_dir
    from engine.model.quant import resolve
    from engine.model.weights import check_checkpoint

    bundled = bundled_model_dir()  # 8.3M parameters: int8 where our kernels run, measured
    assert bundled is not None
    assert resolve(check_checkpoint(bundled)[0], "auto", "cpu") == \
        ("int8" if native.available() else "none")
    monkeypatch.setattr("engine.model.quant.AUTO_PARAMS", 1)  # every model is large
    large = Engine.load(hybrid_dir, quant="auto")
    if native.available():
        assert large.model.quant == "int8"
        amx = "+amx" if native.kernels().amx else ""  # (the CPU's AMX tiles: wq.c)
        assert describe(large.model) == f"int8 (vnni{amx} kernels; drafts int4) (auto)"
    else:  # torch's one-row kernels do not pay for themselves: auto keeps the weights
        assert large.model.quant == "none"
