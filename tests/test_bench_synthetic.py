"""`ahead bench engine --synthetic-acceptance`: drafts kept with the chosen probability per
position whatever the model says (random weights accept nothing), so that speculative speed
on real shapes can be timed as llama-server's --spec-synth-rates times it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams, native
from engine.decode.policy import TextKind
from engine.exec.calibration import warm_up


def test_rates_of_one_keep_every_draft_and_zero_none(random_dir: Path) -> None:
    engine = Engine.load(random_dir, max_seq_len=256, k_max=4, slots=1)
    prompt = list(range(300, 340))
    kept = {}
    for rate in (1.0, 0.0):
        engine.state.synthetic = torch.full((4,), rate)
        gen = engine.generate(prompt, GenParams(40, k=3, stop_loops=False))
        kept[rate] = (gen.stats.accepted, gen.stats.drafted)
    assert kept[1.0][0] == kept[1.0][1] > 0 and kept[0.0][0] == 0 < kept[0.0][1]


def test_a_warm_up_teaches_the_k_policy_nothing(random_dir: Path) -> None:
    """The warm-up's generations (a made-up prompt, steps that compile or capture) are not
    serving's text or costs: the policy chooses after them as before. On the H200 a warm-up
    with random weights taught it that no draft is kept, and adaptive K on Qwen2-1.5B's
    shapes made 515 tokens/s under synthetic acceptance where K=4 made 783."""
    engine = Engine.load(random_dir, max_seq_len=256, k_max=4, slots=1)
    policy = engine.policy
    policy.set_costs([1.0] * 5)  # drafts cost nothing: an adaptive row drafts every step

    def state() -> tuple[object, ...]:
        best = policy.best(TextKind.CODE)  # sets policy.rate
        return best, policy.learned(), policy.report(), dict(vars(policy.probes)), policy.rate

    before = state()
    assert before[0] == 4
    warm_up(engine)
    assert state() == before
    # outside a warm-up, steps do teach it (random weights keep no draft of the modules)
    engine.generate(list(range(300, 340)), GenParams(8, drafts="mtp", ignore_eos=True))
    assert policy.learned() != before[1] and policy.rates(TextKind.CODE)[0] < 0.6


def test_the_bench_reports_speed_by_k_at_the_chosen_acceptance(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "clients.cli", "bench", "engine", "--preset",
                           "tiny-qwen3", "--synthetic-acceptance", "1,1", "--ks", "1,2",
                           "--context", "64", "--max-new-tokens", "25", "--rounds", "3",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert set(r["tokens_per_s_by_k"]) == {"1", "2"} and r["identical_to_ar"] is None
    assert r["dtype"] == "float32"  # no --dtype, unquantized (auto, a tiny model): fp32
    assert r["synthetic_acceptance"] == [1.0, 1.0]
    # every draft kept: K=2 makes 3 tokens a step (the last may be cut by the token limit);
    # what that buys in tokens/s is the bench's figure, not a test's
    assert 2.5 <= r["tokens_per_step_by_k"]["2"] <= 3
    assert 1.5 <= r["tokens_per_step_by_k"]["1"] <= 2
    # the adaptive run's Ks, steps of each (in the summary too)
    hist = r["adaptive_k_histogram"]
    assert hist and set(map(int, hist)) <= set(range(9)) and all(n > 0 for n in hist.values())
    assert "adaptive K: " in proc.stdout and "(K:steps " in proc.stdout
    # adaptive K takes its turns with the others, round after round, its policy learning on:
    # its first round (the policy as loaded) is said apart
    assert r["adaptive_first_round_tokens_per_s"] > 0 and "; its first round " in proc.stdout
    assert len(r["round_step_ms"]["adaptive"]) == 3 and sum(hist.values()) > 3
    # the modes took turns 3 times; a K's ratio to plain decoding is the median of its rounds'
    assert r["rounds"] == 3 and "round 3 of 3" in proc.stderr
    # fp32 here: by steps where a lone step runs one row, else by generations (said so)
    assert r["turns"] == "steps" or "runs a row for every slot" in proc.stderr
    rounds = r["round_step_ms"]  # each mode's median step in each round
    assert set(rounds) == {"plain", "k1", "k2", "verify1", "verify2", "adaptive"}
    for k in ("1", "2"):
        ratios = sorted(a / b for a, b in zip(rounds[f"k{k}"], rounds["plain"], strict=True))
        assert r["step_ratio_by_k"][k] == pytest.approx(ratios[1])
        assert r["draft_ms_by_k"][k] == (r["step_ms_by_k"][k] - r["verify_ms_by_k"][k]) / int(k)
    zero = subprocess.run([sys.executable, "-m", "clients.cli", "bench", "engine", "--preset",
                           "tiny-qwen3", "--rounds", "0"], capture_output=True, text=True,
                          timeout=600)
    assert zero.returncode != 0 and "--rounds must be at least 1" in zero.stderr
    bad = subprocess.run([sys.executable, "-m", "clients.cli", "bench", "engine", "--preset",
                          "tiny-qwen3", "--synthetic-acceptance", "0.9,1.5"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "[0, 1]" in bad.stderr


def test_the_modes_take_turns_step_by_step_where_each_has_a_slot_of_its_own() -> None:
    """Each mode's generation in a slot of its own, one step each in turn: a drift of the
    machine's speed moves all of them alike. With one slot, whole generations by turns."""
    from clients.bench.steps import bench_engine, bench_steps, preset_engine

    made: list[int] = []

    def make(dtype: torch.dtype) -> Callable[[int], Engine]:
        def engine(slots: int) -> Engine:
            made.append(slots)
            return preset_engine("tiny-qwen3", device="cpu", dtype=dtype, max_seq_len=256,
                                 k_max=2, slots=slots)
        return engine

    said: list[str] = []
    fp32 = bench_engine(make(torch.float32), 1, [1, 2], 2, said.append)
    if made == [6, 1]:  # a lone fp32 step here runs a row for every slot: made again
        assert fp32.max_slots == 1 and "runs a row for every slot" in said[0]
    else:
        assert made == [6] and fp32.step_rows(1) == 1 and not said
    made.clear()
    stepwise = bench_engine(make(torch.bfloat16), 1, [1, 2], 2, said.append)
    if made != [6]:
        pytest.skip("a lone bf16 step on this CPU runs a row for every slot")
    said.clear()
    r = bench_steps(stepwise, context=48, new_tokens=20, ks=[1, 2], progress=said.append)
    assert r["turns"] == "steps" and any("step by step (round 2 of 2)" in s for s in said)
    assert r["identical_to_ar"] is True  # every K's output is plain decoding's, slot by slot
    assert set(r["round_step_ms"]) == {"plain", "k1", "k2", "verify1", "verify2", "adaptive"}
    assert all(len(v) == 2 for v in r["round_step_ms"].values())
    kept = bench_steps(stepwise, context=48, new_tokens=20, ks=[2], synthetic=[1, 1],
                       rounds=1)
    assert kept["turns"] == "steps" and 2.5 <= kept["tokens_per_step_by_k"]["2"] <= 3
    # each round's modes share one seed, so the synthetic draws are the same at the same
    # positions: a mode's tokens per step repeat from run to run
    again = [bench_steps(stepwise, context=48, new_tokens=20, ks=[1, 2], synthetic=[0.6, 0.5],
                         rounds=2)["tokens_per_step_by_k"] for _ in range(2)]
    assert again[0] == again[1]
    alone = bench_steps(make(torch.bfloat16)(1), context=48, new_tokens=20, ks=[1], rounds=1)
    assert alone["turns"] == "generations" and alone["identical_to_ar"] is True


@pytest.mark.skipif(native.status() != "vnni", reason="our CPU kernels do not run here")
def test_the_bench_says_where_each_modes_step_spends_its_time(tmp_path: Path) -> None:
    """Each of our kernels timed as the modes' steps run: a part's calls a step, its ms, and
    the rest (torch's operators and Python), for plain decoding, each K and each verify."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "clients.cli", "bench", "engine", "--preset",
                           "tiny-qwen3", "--quant", "int4",
                           "--synthetic-acceptance", "1,1", "--ks", "1,2", "--context", "48",
                           "--max-new-tokens", "14", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    from engine import native  # no --dtype: our int4 kernels run bf16 where the CPU dots it

    bf16 = native.available() and native.kernels().bf16_dot
    assert r["dtype"] == ("bfloat16" if bf16 else "float32")
    if r["turns"] != "steps":
        pytest.skip("a lone bf16 step on this CPU runs a row for every slot")
    ms, calls = r["breakdown_ms"], r["breakdown_calls"]
    assert set(ms) == set(calls) == {"plain", "k1", "k2", "verify1", "verify2", "adaptive"}
    layers = 3  # tiny-qwen3's blocks: q/k/v, o, gate/up, down products each; then the head
    products, blocks = "int8/int4 products", "decoder blocks in one call (layer.c)"
    assert "delta rule" not in calls["plain"]
    if bf16:  # the trunk one call of layer.c (its blocks' products, attention, norms inside)
        assert calls["plain"][blocks] == calls["verify2"][blocks] == 1
        assert calls["plain"][products] == calls["verify2"][products] == 1  # the head
        assert "attention" not in calls["plain"]
        # K=2's steps also draft: each draft one call of mtp.c (the module's block, its
        # projection, norms and the head's pick inside it)
        drafts = "MTP drafts in one call (mtp.c)"
        assert calls["k2"][drafts] > calls["k1"][drafts] > 0
        assert drafts not in calls["plain"] and drafts not in calls["verify2"]
        parts = {products, blocks, "norms"}
    else:  # fp32: the block's Python forward, each kernel a call of its own
        assert calls["plain"][products] == calls["verify2"][products] == 4 * layers + 1
        assert calls["plain"]["attention"] == layers and blocks not in calls["plain"]
        assert calls["k2"][products] > calls["k1"][products] > calls["verify2"][products]
        parts = {products, "attention"}
    for mode in ms.values():
        assert parts <= set(mode)
        assert all(v > 0 for v in mode.values())
        assert mode["step"] == pytest.approx(sum(v for p, v in mode.items() if p != "step"))
    assert "where a step's time goes" in proc.stdout
    assert "the rest: torch's operators, Python" in proc.stdout
    head, *table = proc.stdout.split("where a step's time goes")[1].splitlines()
    assert "/ K=2 / adaptive K;" in head
    labels = [line.split(":")[0] for line in table if line.startswith("  ")]
    assert len(labels) == len(set(labels)) > 4  # each part once, with a figure per mode
