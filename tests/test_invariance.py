"""The invariance probe's decisions, on any CPU: a model one of whose linear layers computes a
row by another path depending on where the row sits in the call (as matmul libraries do: a
one-row product by a matrix-vector kernel, the remainder rows of a tile by another kernel),
each kind of dependence giving its own step shape; and the engine keeping its contract in
the shape the probe returns, or, where none keeps it, refusing `exact=True` with the reason
and running without the promise under auto, saying so."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from daemon.backends.local import LocalBackend
from engine import Engine, ExactnessUnavailable, Generation, GenParams
from engine.exec.invariance import BY_POSITION, BY_SIZE, Invariance, probe, probe_depth
from engine.model.transformer import Transformer
from engine.model.weights import load_model
from engine.tokenizer import Tokenizer
from training.synthetic import write_checkpoint

Rule = Callable[[int, int], Tensor]  # (batch, seqlen) of the call -> [B, S] bool: other path
K_MAX, SLOTS = 3, 3
BLOCK = 8
RULES: dict[str, Rule] = {
    # a one-row call goes through a matrix-vector kernel
    "one_row": lambda b, s: torch.full((b, s), b * s == 1),
    # a call of several slots is blocked differently from a call of one
    "batch_size": lambda b, s: torch.full((b, s), b > 1),
    # batch rows after the first take the remainder kernel
    "batch_row": lambda b, s: (torch.arange(b) > 0)[:, None].expand(b, s),
    # positions after the first take the remainder kernel
    "position": lambda b, s: (torch.arange(s) > 0)[None].expand(b, s),
}


class RowPathLinear(nn.Linear):
    """A linear layer computed by one of two kernels per row: the plain product, or one that
    sums the reduction in blocks of BLOCK, rounding each (as a kernel blocking it otherwise
    would).
    `rule` says which rows of a call [B, S, in] take the second."""

    def __init__(self, linear: nn.Linear, rule: Rule) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.load_state_dict(linear.state_dict())
        self.rule = rule

    def forward(self, x: Tensor) -> Tensor:
        plain = F.linear(x, self.weight, self.bias)
        parts = [F.linear(xs, ws) for xs, ws in zip(x.split(BLOCK, -1),
                                                     self.weight.split(BLOCK, -1), strict=True)]
        split = sum(parts[1:], parts[0] if self.bias is None else parts[0] + self.bias)
        other = self.rule(x.shape[0], x.shape[1]).to(x.device)[..., None]  # [B, S, 1]
        return torch.where(other, split, plain)


@pytest.fixture(scope="module")
def random_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights: near-ties everywhere, so that a row computed the other way changes
    tokens (what shows that a wrong step shape would be caught)."""
    path = tmp_path_factory.mktemp("rowpath")
    write_checkpoint(path, "tiny-qwen3", seed=3)
    return path


def model_with(path: Path, rule: str | None) -> Transformer:
    model = load_model(path, dtype=torch.bfloat16)  # where auto asks for exactness
    if rule is not None:  # every layer's output projections
        for layer in model.model.layers:
            layer.mlp.down_proj = RowPathLinear(layer.mlp.down_proj, RULES[rule])
            layer.self_attn.o_proj = RowPathLinear(layer.self_attn.o_proj, RULES[rule])
    return model


def engine_with(path: Path, rule: str | None, exact: bool | None = True) -> Engine:
    engine = Engine(model_with(path, rule), Tokenizer.from_dir(path), max_seq_len=256,
                    k_max=K_MAX, slots=SLOTS, exact=exact)
    engine.calibrate()
    return engine


@pytest.fixture(scope="module")
def base(random_qwen3: Path) -> Invariance:
    """What this CPU gives the model without the rule (every rule's decision adds to it)."""
    model = model_with(random_qwen3, None)
    model.fuse()
    return probe(model, K_MAX + 1, SLOTS)


def decide(path: Path, rule: str) -> Invariance:
    model = model_with(path, rule)
    model.fuse()
    return probe(model, K_MAX + 1, SLOTS)


def test_rows_that_differ_by_position_in_the_window_keep_no_shape(random_qwen3: Path) -> None:
    inv = decide(random_qwen3, "position")
    assert not inv.exact and inv.reason == BY_POSITION


@pytest.mark.parametrize("rule", ["one_row", "batch_size", "batch_row"])
def test_each_dependence_gets_a_shape_that_avoids_it(random_qwen3: Path, base: Invariance,
                                                     rule: str) -> None:
    inv = decide(random_qwen3, rule)
    if not base.exact:  # this CPU keeps no shape for the model alone: nor with the rule
        assert not inv.exact
        return
    assert inv.exact
    if rule == "one_row":  # a plain step alone never runs one row
        assert inv.min_width > 1 or not inv.batch_invariant
    elif rule == "batch_size":  # every step runs all slots, in any order, or each alone
        assert not inv.batch_invariant
    else:  # every slot runs in a call of its own
        assert not inv.batch_invariant and inv.alone


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(300, 500, (n,), generator=gen).tolist() for n in (40, 9, 23)]


Output = tuple[list[int], list[float]]  # tokens, and the bits of their log-probabilities


def outputs(engine: Engine) -> tuple[list[Output], list[Output], list[Output]]:
    """Each prompt's plain decoding alone; the three speculative at every K alone; and the
    three batched (different K, one plain)."""
    def out(g: Generation) -> Output:
        return g.tokens, g.logprobs

    plain = [out(engine.generate(p, GenParams(24, speculative=False, stop_loops=False),
                                 slot="alone")) for p in prompts()]
    alone = [out(engine.generate(p, GenParams(24, k=k, stop_loops=False), slot="alone"))
             for p in prompts() for k in (*range(1, K_MAX + 1), None)]
    ks = (K_MAX, 0, None)
    gens = [engine.start(p, GenParams(24, k=k, speculative=k != 0, stop_loops=False),
                         slot=("batch", i))
            for i, (p, k) in enumerate(zip(prompts(), ks, strict=True))]
    while live := [g for g in gens if g.finish_reason is None]:
        engine.step(live)
    return plain, alone, [out(g) for g in gens]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["batch_size", "batch_row"])
def test_the_engine_keeps_the_contract_in_the_probes_shape(random_qwen3: Path,
                                                           base: Invariance, rule: str) -> None:
    engine = engine_with(random_qwen3, rule, exact=None if not base.exact else True)
    if not base.exact:
        assert not engine.exact and engine.exactness.startswith("unavailable")
        return
    plain, alone, batched = outputs(engine)
    assert alone == [t for t in plain for _ in range(K_MAX + 1)]
    assert batched == plain
    # The same engine in the cheapest shape: the rule changes the bits there (so the
    # comparisons above can fail)
    engine.invariance = Invariance.unconstrained()
    assert outputs(engine)[2] != plain


def by_rows(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """A product whose rows are their own: each row in a call of one."""
    return torch.stack([F.linear(r, w, b) for r in x.unbind(1)], 1)


def test_the_kernel_sweep_finds_products_whose_rows_change_with_the_calls_size() -> None:
    """What a model's few positions miss (on an AVX-512 CPU without AVX512-BF16, oneDNN's
    bf16 products round a row otherwise now and then as the call grows): the sweep runs the
    forward's products in calls of every size and bounds the window, or finds none."""
    from engine.exec.invariance import _kernel_width

    gen = torch.Generator().manual_seed(0)
    linears = {i: (torch.randn(n, 64, generator=gen), None, torch.float32)
               for i, n in enumerate((96, 64))}

    def nudged(when: Callable[[int], bool]) -> Callable[..., Tensor]:
        def product(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
            y = by_rows(x, w, b)
            return y.nextafter(torch.full_like(y, float("inf"))) if when(x.shape[1]) else y
        return product

    assert _kernel_width(linears, 4, 3, 0, by_rows) == 1
    assert _kernel_width(linears, 4, 3, 0, nudged(lambda rows: rows == 1)) == 2
    assert _kernel_width(linears, 4, 3, 0, nudged(lambda rows: rows < 3)) == 3
    assert _kernel_width(linears, 4, 3, 0, nudged(lambda rows: rows >= 17)) is None  # prefills


def test_the_probe_keeps_the_window_the_kernel_sweep_allows(
        random_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.exec import invariance

    model = model_with(random_qwen3, None)
    model.fuse()
    swept: list[int] = []
    monkeypatch.setattr(invariance, "_kernel_width",
                        lambda linears, *a: swept.append(len(linears)) or 3)
    inv = probe(model, K_MAX + 1, SLOTS)
    assert swept and swept[0] >= 3  # the fused QKV, output, gate-up, down and head products
    if inv.exact:  # on a CPU whose model-level rows agree in some shape
        assert inv.min_width >= 3
    monkeypatch.setattr(invariance, "_kernel_width", lambda *a: None)
    inv = probe(model, K_MAX + 1, SLOTS)
    assert not inv.exact and inv.reason in (BY_SIZE, BY_POSITION)


def test_exact_on_a_device_that_cannot_keep_it_is_refused_with_the_reason(
        random_qwen3: Path) -> None:
    with pytest.raises(ExactnessUnavailable, match="rows of one call differ by position"):
        engine_with(random_qwen3, "position", exact=True)


def test_auto_runs_without_the_promise_and_says_so(random_qwen3: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="ahead.engine"):
        engine = engine_with(random_qwen3, "position", exact=None)
    said = "exact: unavailable on this device (rows of one call differ by position)"
    assert engine.exactness == said.removeprefix("exact: ")
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    assert not engine.exact and engine.invariance == Invariance.unconstrained()
    assert LocalBackend(engine).status()["exact"] == engine.exactness
    gen = engine.generate(prompts()[0], GenParams(8))  # and it decodes
    assert len(gen.tokens) == 8


def test_a_second_load_reads_the_calibration_and_other_settings_measure_afresh(
        tmp_path: Path) -> None:
    model_dir, cache = tmp_path / "model", tmp_path / "cache" / "quant"
    write_checkpoint(model_dir, "tiny-qwen3", seed=5)
    first = Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=128, k_max=3, slots=2,
                        quant_cache=cache)
    entries = list((cache.parent / "calibration").glob("*.json"))
    assert len(entries) == 1 and first.invariance.exact
    # Another invariance and other costs in the entry: a load that reads it takes them.
    stored = json.loads(entries[0].read_text())
    stored["invariance"] |= {"min_width": 3, "batch_invariant": False,  # on any CPU
                             "exact": True, "reason": None}
    stored["costs"] = {r: [0.5 + k for k in range(4)] for r in stored["costs"]}
    entries[0].write_text(json.dumps(stored))
    second = Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=128, k_max=3, slots=2,
                         quant_cache=cache)
    assert (second.invariance.min_width, second.invariance.batch_invariant) == (3, False)
    assert second.policy.cost(2) == 2.5
    third = Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=128, k_max=3, slots=1,
                        quant_cache=cache)  # another number of slots: measured, and kept
    assert third.invariance.exact and third.policy.cost(2) != 2.5
    assert len(list((cache.parent / "calibration").glob("*.json"))) == 2


def test_fixed_shape_steps_read_their_own_calibration_and_warm_up_instead_of_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A compiled fixed-shape step (CUDA's kind, here on the CPU) keeps its calibration in an
    entry of its own (its costs are not the eager step's): a second load reads it, measures
    nothing and compiles in its warm-up; where that warm-up fails, it runs eager, measured."""
    from engine.decode import costs
    from engine.exec import compile as compile_mod

    model_dir, cache = tmp_path / "model", tmp_path / "cache" / "quant"
    write_checkpoint(model_dir, "tiny-qwen3", seed=6)
    kw = {"dtype": torch.bfloat16, "max_seq_len": 128, "k_max": 3, "slots": 2,
          "quant_cache": cache, "fixed_shapes": True,
          "exact": False}  # a CPU without the promise leaves its fixed shape
    first = Engine.load(model_dir, compile=True, **kw)  # type: ignore[arg-type]
    Engine.load(model_dir, compile=False, **kw)  # type: ignore[arg-type]
    entries = sorted((cache.parent / "calibration").glob("*.json"), key=lambda f: f.stat().st_mtime)
    assert len(entries) == 2  # the compiled step's and the eager one's
    stored = json.loads(entries[0].read_text())
    stored["costs"] = {r: [0.5 + k for k in range(4)] for r in stored["costs"]}
    entries[0].write_text(json.dumps(stored))
    measured = []
    real = costs.measure_costs
    monkeypatch.setattr("engine.exec.calibration.measure_costs",
                        lambda *a, **k: measured.append(1) or real(*a, **k))
    second = Engine.load(model_dir, compile=True, **kw)  # type: ignore[arg-type]
    assert not measured and second.policy.cost(2) == 2.5 and second.compiled
    prompt = list(range(300, 340))
    assert second.generate(prompt, GenParams(12, k=3)).tokens == \
        first.generate(prompt, GenParams(12, k=3)).tokens

    def broken(*args: object) -> None:
        raise RuntimeError("the compiler failed")

    monkeypatch.setattr(compile_mod, "verify_window", broken)
    third = Engine.load(model_dir, compile=True, **kw)  # type: ignore[arg-type]
    assert measured and not third.compiled and third.policy.cost(2) != 2.5
    assert "the compiler failed" in caplog.text
    assert third.generate(prompt, GenParams(12, k=3)).tokens == \
        first.generate(prompt, GenParams(12, k=3)).tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_summed_by_key_blocks_keeps_each_rows_bits_its_own(dtype: torch.dtype) -> None:
    """The GPU's attention sums p @ v block by block of keys (`weighted_values`): the value of
    one product within rounding, and a row's bits depend on its own probabilities alone."""
    from engine.cache.kv import KEY_BLOCK
    from engine.model.attention import weighted_values

    gen = torch.Generator().manual_seed(0)
    keys = 3 * KEY_BLOCK
    probs = torch.softmax(torch.randn(2, 2, 6, keys, generator=gen) * 3, -1).to(dtype)
    v = torch.randn(2, 2, keys, 64, generator=gen).to(dtype)
    blocked = weighted_values(probs, v, blocks=True)
    assert blocked.dtype == dtype and blocked.shape == (2, 2, 6, 64)
    one = (probs.double() @ v.double()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(blocked.float(), one.float(), atol=tol, rtol=tol)
    assert torch.equal(weighted_values(probs, v, blocks=False), probs @ v)
    # other rows' probabilities change nothing in a row (whether a row alone gives the bits
    # it gives among others depends on the device's matmul: the probe measures that)
    other = probs.clone()
    other[:, :, 1:] = torch.softmax(torch.randn(2, 2, 5, keys, generator=gen), -1).to(dtype)
    assert torch.equal(weighted_values(other, v, blocks=True)[:, :, 0], blocked[:, :, 0])
    # keys not in whole blocks: one product
    assert torch.equal(weighted_values(probs[..., :-1], v[:, :, :-1], blocks=True),
                       probs[..., :-1] @ v[:, :, :-1])


def test_the_probe_runs_the_first_layer_of_each_kind() -> None:
    """The probe's trunk stops after the first layer of the last kind to appear."""
    hybrid = ["linear_attention"] * 3 + ["full_attention"]
    assert probe_depth(hybrid * 6) == 4
    assert probe_depth(["full_attention"] * 28) == 1
    assert probe_depth(["sliding_attention"] * 5 + ["full_attention"] + ["x"] * 2) == 7
