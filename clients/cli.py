"""The `ahead` command line.

Imports of torch and the engine happen inside the commands that need them, so that light
commands (and, later, `ahead lsp`) start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from clients import daemon_cmds, generate_cmds
from clients.common import CliError, add_model_args, load_engine, model_dir
from daemon.config import BACKENDS, FIM_TEMPLATES

EXIT_ERROR, EXIT_INTERRUPTED = 1, 130


def _report(text: str, result: dict[str, Any], json_path: str | None) -> None:
    """A bench's report printed, and its results written as JSON where --json asks."""
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")


def _whole_numbers(text: str, flag: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise CliError(f"{flag}: whole numbers, comma-separated, not {text!r}") from None


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from clients.bench.edits import edit_prompts
    from clients.bench.engine import bench_engine, cursor_prompts, format_report, heldout_loss
    from engine.decode.sources import DRAFTS

    if args.preset or args.slots > 1 or args.context or args.synthetic_acceptance:
        return _bench_steps(args)
    files, sources = _bench_files(args)
    drafts = tuple(d.strip() for d in args.drafts.split(","))
    if not drafts or not set(drafts) <= set(DRAFTS):
        raise CliError(f"--drafts: a comma-separated list of {', '.join(DRAFTS)}, "
                       f"got {args.drafts!r}")
    engine = load_engine(args, mtp=not args.without_mtp)
    make = edit_prompts if args.workload == "edit" else cursor_prompts
    prompts = make(engine, files, args.num_prompts, args.seed,
                   max_new_tokens=args.max_new_tokens)
    ks = None if args.ks is None else [int(k) for k in args.ks.split(",")]

    def progress(done: int, total: int) -> None:
        print(f"\rbench: prompt {done}/{total}", end="" if done < total else "\n",
              file=sys.stderr, flush=True)

    with contextlib.ExitStack() as stack:
        peer = None
        if args.peer:
            import torch

            from clients.bench.peer import LlamaServer, PeerError
            if not args.peer_model:
                raise CliError("--peer needs --peer-model (the same model as a GGUF file)")
            try:
                peer = stack.enter_context(LlamaServer(
                    Path(args.peer), Path(args.peer_model), threads=torch.get_num_threads(),
                    context=engine.max_seq_len, extra=shlex.split(args.peer_args))).complete
            except PeerError as e:
                raise CliError(str(e)) from None
        result = bench_engine(engine, prompts, max_new_tokens=args.max_new_tokens, ks=ks,
                              drafts=drafts, peer=peer, progress=progress)
    if peer is not None:
        result["peer"]["args"] = args.peer_args
    result["heldout_loss"] = heldout_loss(engine, files)
    result["model"] = str(model_dir(args)) + (" (without its MTP modules)" * args.without_mtp)
    if engine.model.assistant is not None:  # drafting in the MTP modules' place
        result["drafter"] = "assistant"
    result["workload"] = args.workload
    result["sources"] = sources
    result["device"] = str(engine.device)
    result["dtype"] = str(engine.dtype).removeprefix("torch.")
    result["exact"] = engine.exactness
    result["load_s"] = engine.load_seconds
    _report(format_report(result), result, args.json)
    return 0


def _bench_steps(args: argparse.Namespace) -> int:
    from clients.bench import steps
    from clients.common import engine_options

    # the MTP modules' steps (the context's drafts are not what synthetic rates stand for)
    mtp_only = {"drafts": "mtp"}
    if args.rounds < 1:
        raise CliError(f"--rounds must be at least 1, not {args.rounds}")
    if args.peer:  # checked before minutes of our own runs, not after them
        if not args.peer_model:
            raise CliError("--peer needs --peer-model (the same shapes as a GGUF file)")
        for path, what in ((args.peer, "llama-server binary"), (args.peer_model, "GGUF model")):
            if not Path(path).is_file():
                raise CliError(f"{what} {path} does not exist")
    if args.preset and args.draft_model:
        raise CliError("--draft-model drafts for a checkpoint, not a preset")
    synthetic = None
    if args.synthetic_acceptance:
        try:
            synthetic = [float(p) for p in args.synthetic_acceptance.split(",")]
        except ValueError:
            synthetic = None
        if synthetic is None or not all(0 <= p <= 1 for p in synthetic):
            raise CliError("--synthetic-acceptance takes probabilities in [0, 1], "
                           f"comma-separated, not {args.synthetic_acceptance!r}")
    ks = None if args.ks is None else [int(k) for k in args.ks.split(",")]
    options = engine_options(args) | mtp_only

    def make(slots: int) -> Any:
        if not args.preset:
            return load_engine(args, **(mtp_only | {"slots": slots}))
        try:
            return steps.preset_engine(args.preset, **(options | {"slots": slots}))
        except ValueError as e:
            raise CliError(str(e)) from None

    def progress(what: str) -> None:
        print(f"bench: {what}", file=sys.stderr, flush=True)

    engine = steps.bench_engine(make, options["slots"], ks, options["k_max"], progress)
    name = args.preset or str(model_dir(args))

    import functools

    import torch

    from clients.bench.peer import PeerError, peer_steps

    peer = None
    if args.peer:
        peer = functools.partial(peer_steps, Path(args.peer), Path(args.peer_model),
                                 threads=torch.get_num_threads(), k_max=engine.k_max,
                                 synthetic=synthetic)
    try:
        result = steps.bench_steps(engine, context=args.context or 2000,
                                   new_tokens=args.max_new_tokens, ks=ks, slots=args.slots,
                                   synthetic=synthetic, progress=progress, peer=peer,
                                   rounds=args.rounds)
    except PeerError as e:
        raise CliError(str(e)) from None
    result |= {"preset": name, "device": str(engine.device),
               "dtype": str(engine.dtype).removeprefix("torch."),
               "graphs": engine.graphs, "compiled": engine.compiled}
    _report(steps.format_report(result), result, args.json)
    return 0


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    import asyncio

    from clients.bench.pipeline import bench_pipeline, format_report
    from training.corpus import heldout_stdlib_files

    files = [Path(f) for f in args.files] if args.files else heldout_stdlib_files()
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CliError(f"file {missing[0]} does not exist")
    def progress(done: int, total: int) -> None:
        print(f"\rbench: round {done}/{total}", end="" if done < total else "\n",
              file=sys.stderr, flush=True)

    try:
        result = asyncio.run(bench_pipeline(model_dir(args), files, clients=args.clients,
                                            keystrokes=args.keystrokes,
                                            interval_ms=args.interval_ms, seed=args.seed,
                                            rounds=args.rounds, serve_args=_serve_args(args),
                                            progress=progress))
    except ValueError as e:
        raise CliError(str(e)) from None
    _report(format_report(result), result, args.json)
    return 0


def _remote_backend_args(parser: argparse.ArgumentParser) -> None:
    """A bench's choice of backend, read by `_serve_args`."""
    parser.add_argument("--backend", choices=BACKENDS, default="local",
                        help="openai: the daemon in front of the server at --url")
    parser.add_argument("--url", help="the remote server's API, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--tokenizer", help="the served model's tokenizer directory "
                        "(default: --model's)")
    parser.add_argument("--served-model", help="the model name the server serves")
    parser.add_argument("--fim-template", choices=FIM_TEMPLATES)


def _serve_args(args: argparse.Namespace) -> list[str]:
    """The bench daemon's backend: the local engine, or (`--backend openai`) the server at
    --url, with prompts built by --model's tokenizer."""
    if args.backend != "openai":
        return []
    if not args.url:
        raise CliError("--backend openai needs --url (the server's API)")
    out = ["--backend", "openai", "--url", args.url,
           "--tokenizer", args.tokenizer or str(model_dir(args))]
    out += ["--served-model", args.served_model] if args.served_model else []
    return out + (["--fim-template", args.fim_template] if args.fim_template else [])


def cmd_bench_typist(args: argparse.Namespace) -> int:
    import asyncio

    from clients.bench.typist import bench_typist, format_report
    from training.corpus import heldout_stdlib_files

    files = [Path(f) for f in args.files] if args.files else heldout_stdlib_files()[:4]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CliError(f"file {missing[0]} does not exist")
    def progress(what: str) -> None:
        print(f"bench: writing {what}", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(bench_typist(model_dir(args), files, cps=args.cps,
                                          chars=args.chars, start=args.start,
                                          read_ms=args.read_ms, think_ms=args.think_ms,
                                          budget_ms=args.budget_ms,
                                          serve_args=_serve_args(args), progress=progress))
    except ValueError as e:
        raise CliError(str(e)) from None
    _report(format_report(result), result, args.json)
    return 0


def cmd_lsp(args: argparse.Namespace) -> int:
    from lsp.server import main as serve_lsp

    serve_lsp()
    return 0


def cmd_bench_lsp(args: argparse.Namespace) -> int:
    import asyncio

    from clients.bench.lsp import bench_lsp, format_report
    from training.corpus import heldout_stdlib_files

    file = Path(args.file) if args.file else heldout_stdlib_files()[0]
    if not file.is_file():
        raise CliError(f"file {file} does not exist")
    result = asyncio.run(bench_lsp(model_dir(args), file, keystrokes=args.keystrokes))
    _report(format_report(result), result, args.json)
    return 0


def cmd_bench_draft_pick(args: argparse.Namespace) -> int:
    from clients.bench.draft_pick import bench_draft_pick, format_report

    tiles = _whole_numbers(args.tiles, "--tiles")
    try:
        result = bench_draft_pick(model_dir(args), [Path(f) for f in args.files], tiles,
                                  draft_vocab=args.draft_vocab, prompts=args.prompts,
                                  context=args.context, tokens=args.tokens, k=args.k)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(f"bench draft-pick: {e}") from None
    _report(format_report(result), result, args.json)
    return 0


def cmd_bench_draft_vocab(args: argparse.Namespace) -> int:
    from clients.bench.draft_vocab import bench_draft_vocab, format_report

    sizes = _whole_numbers(args.sizes, "--sizes")
    try:
        result = bench_draft_vocab(model_dir(args), [Path(f) for f in args.files], sizes,
                                   chars=args.chars)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(f"bench draft-vocab: {e}") from None
    _report(format_report(result), result, args.json)
    return 0


def _bench_files(args: argparse.Namespace) -> tuple[list[Path], list[dict[str, str]]]:
    """The code a bench samples: --outside (installed projects the bundled model never saw,
    with their versions and licences), --files, else the held-out standard library."""
    if args.outside:
        from clients.bench.docquality import outside_code

        try:
            files, sources = outside_code()
        except (ValueError, ImportError) as e:
            raise CliError(f"--outside: {e}") from None
        for src in sources:
            print(f"code: {src['project']} {src['version']} ({src['licence']}), "
                  f"{src['files']} files")
        return files, sources
    from training.corpus import heldout_stdlib_files

    files = [Path(f) for f in args.files] if args.files else heldout_stdlib_files()
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CliError(f"file {missing[0]} does not exist")
    return files, []


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from clients.bench.quality import bench_quality, choose, format_report, plot

    files, sources = _bench_files(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    engine = load_engine(args)

    def progress(what: str) -> None:
        print(f"\rbench: {what}   ", end="", file=sys.stderr, flush=True)

    result = bench_quality(engine, files, num=args.num, docs=args.docs, seed=args.seed,
                           max_tokens=args.max_tokens, progress=progress)
    print(file=sys.stderr)
    result["chosen"] = choose(result, min_shown=args.min_shown, min_written=args.min_written)
    result["files"] = [str(f) for f in files]
    result["sources"] = sources
    print(format_report(result))
    if args.save:
        from daemon.config import save_model_quality

        measured = [f"{x['project']} {x['version']} ({x['licence']})" for x in sources] or \
            sorted({Path(f).name for f in result["files"]})
        where = save_model_quality(model_dir(args), result["chosen"], measured)
        print(f"saved the chosen thresholds for this model in {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from clients.models_cmd import command

    return command(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from clients.doctor import command

    return command(args)


def cmd_docstrings(args: argparse.Namespace) -> int:
    from clients.docstrings import command

    return command(args, load_engine, model_dir)


def cmd_new_model(args: argparse.Namespace) -> int:
    from engine.model.presets import ASSISTANTS
    from training.synthetic import write_assistant, write_checkpoint

    path = Path(args.dir)
    # a Gemma 4 preset's drafter goes beside the model (pass it as --draft-model)
    assistant = path.with_name(path.name + "-assistant") if args.preset in ASSISTANTS else None
    for out in (path, assistant):
        if out and out.exists() and any(out.iterdir()) and not args.force:
            raise CliError(f"{out} exists and is not empty (--force overwrites the model files)")
    print(f"writing a {args.preset} checkpoint to {path}"
          + (f" (training {args.train_steps} steps)" if args.train_steps else ""), file=sys.stderr)
    cfg = write_checkpoint(path, args.preset, seed=args.seed, train_steps=args.train_steps,
                           mtp_naming=args.naming)
    print(path)
    if assistant is not None:
        print(f"writing its assistant (random weights) to {assistant}", file=sys.stderr)
        write_assistant(assistant, args.preset, cfg, seed=args.seed)
        print(assistant)
    return 0


def _log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.heads_only:
        return _train_heads(args)
    from engine.bundled import install_bundled
    from training.train import TrainConfig, train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(out=args.out, preset=args.preset, steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      corpus_chars=int(args.corpus_mb * 1e6), seed=args.seed,
                      fim_rate=args.fim_rate, spm_rate=args.spm_rate,
                      save_every=args.save_every, head_steps=args.head_steps, device=device)
    train(cfg, _log)
    trained = Path(args.out) / "model"
    if args.install:
        _log(f"installed as the bundled model: {install_bundled(trained)}")
    print(trained)
    return 0


def _train_heads(args: argparse.Namespace) -> int:
    from training.heads import corpus_batches, heads_for

    target = model_dir(args)
    batches = corpus_batches(target, args.batch_size, args.seq_len, args.seed)
    path = heads_for(target, batches, steps=args.steps, lr=args.lr, log=_log)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ahead", description="Local code completion with "
                                     "multi-token-prediction speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a prompt")
    gen.add_argument("prompt", help="the prompt text, or - to read stdin")
    add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--k", type=int, help="fixed number of drafts (default: adaptive)")
    gen.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding")
    gen.add_argument("--stats", action="store_true", help="print speed figures to stderr")
    gen.add_argument("--json", action="store_true", help="one JSON object instead of a stream")
    gen.add_argument("--no-daemon", action="store_true", help="run the model in this process")
    gen.add_argument("--raw", action="store_true", help="stream whatever the model writes, "
                     "unjudged (default: the completion only if it passes the quality rules)")
    gen.add_argument("--min-confidence", type=float, help="the confidence a completion "
                     "needs (default: min_confidence in the config; 0: any)")
    gen.set_defaults(func=generate_cmds.cmd_generate)

    comp = sub.add_parser("complete", help="the completion at FILE:LINE:COL (1-based; "
                          "FILE - reads stdin)")
    comp.add_argument("location")
    add_model_args(comp)
    comp.add_argument("--max-tokens", type=int, default=64)
    comp.add_argument("--json", action="store_true")
    comp.add_argument("--no-daemon", action="store_true", help="run the model in this process")
    comp.set_defaults(func=generate_cmds.cmd_complete)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    eng = bench_sub.add_parser("engine", help="AR vs MTP decoding at each K and adaptive K")
    add_model_args(eng)
    eng.add_argument("--files", nargs="+", help="source files to cut prompts from "
                     "(default: held-out standard-library modules)")
    eng.add_argument("--outside", action="store_true", help="cut prompts from installed "
                     "projects the bundled model never saw in training (pygls, watchfiles)")
    eng.add_argument("--num-prompts", type=int, default=60,
                     help="prompts, each run in every mode (default 60: with 20, the "
                     "best modes swap places between runs)")
    eng.add_argument("--max-new-tokens", type=int, default=64)
    eng.add_argument("--ks", help="fixed Ks to run, comma-separated (default: 1..k-max)")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--preset", help="time the step on a model of these shapes with random "
                     "weights, built in memory (e.g. qwen2-1.5b); prompts are random tokens")
    eng.add_argument("--slots", type=int, default=1,
                     help="also run this many prompts batched, each checked against its own "
                     "plain decoding (step timings mode)")
    eng.add_argument("--context", type=int, help="prompt tokens in step timings mode "
                     "(default 2000)")
    eng.add_argument("--rounds", type=int, default=2,
                     help="step timings mode: generations per mode, plain decoding and each "
                     "K taking turns (medians over all their steps)")
    eng.add_argument("--synthetic-acceptance", metavar="P1,P2,...",
                     help="step timings mode: keep the draft at position i with probability "
                     "Pi whatever the model says (as llama-server's --spec-synth-rates), to "
                     "time speculation on random weights; output is not the model's")
    eng.add_argument("--peer", metavar="LLAMA_SERVER",
                     help="also decode every prompt with this llama-server binary, greedy, "
                     "on as many threads (needs --peer-model)")
    eng.add_argument("--peer-model", metavar="GGUF",
                     help="the same model for the peer, as GGUF (without its MTP modules)")
    eng.add_argument("--peer-args", default="", metavar="ARGS",
                     help="more llama-server flags for the peer, e.g. '--spec-type ngram-mod' "
                     "(its drafts from the context)")
    eng.add_argument("--drafts", default="mtp,context,both", metavar="SOURCES",
                     help="adaptive modes to run, by where drafts come from: mtp (the "
                     "model's MTP modules, with every fixed K), context (the text so far), "
                     "both (chosen live, as served); comma-separated (default: all three)")
    eng.add_argument("--workload", choices=["heldout", "edit"], default="heldout",
                     help="heldout: the cursor on a line of the files; edit: in a renamed "
                     "copy of one of their functions, after the original (the text to "
                     "write repeats the context)")
    eng.add_argument("--without-mtp", action="store_true",
                     help="load the model's trunk without its MTP modules")
    eng.add_argument("--json", help="write the results to this file")
    eng.set_defaults(func=cmd_bench_engine)
    pipe = bench_sub.add_parser("pipeline", help="a typing burst from several editors "
                                "against a real daemon")
    pipe.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    pipe.add_argument("--files", nargs="+", help="source files the editors type "
                      "(default: held-out standard-library modules)")
    pipe.add_argument("--clients", type=int, default=3)
    pipe.add_argument("--keystrokes", type=int, default=30)
    pipe.add_argument("--interval-ms", type=float, default=40.0)
    pipe.add_argument("--seed", type=int, default=0)
    pipe.add_argument("--rounds", type=int, default=3,
                      help="bursts from new cursor positions, pooled (default: 3)")
    _remote_backend_args(pipe)
    pipe.add_argument("--json", help="write the results to this file")
    pipe.set_defaults(func=cmd_bench_pipeline)
    typ = bench_sub.add_parser("typist", help="a person writing code through the language "
                               "server, with and without prefetch")
    typ.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    typ.add_argument("--files", nargs="+", help="the files to write (default: four held-out "
                     "standard-library modules)")
    typ.add_argument("--cps", type=float, default=8.0, help="typing speed, characters/s")
    typ.add_argument("--chars", type=int, default=400,
                     help="characters written of each file (to the end of that line)")
    typ.add_argument("--start", type=float, default=0.5,
                     help="where in each file to start, as a fraction (0: an empty buffer)")
    typ.add_argument("--read-ms", type=float, default=2000.0,
                     help="how long the person waits for the suggestion after an accept")
    typ.add_argument("--think-ms", type=float, default=300.0,
                     help="how long the person reads a suggestion before taking it")
    typ.add_argument("--budget-ms", type=int, default=2000,
                     help="the language server's time budget per suggestion")
    _remote_backend_args(typ)
    typ.add_argument("--json", help="write the results to this file")
    typ.set_defaults(func=cmd_bench_typist)
    lspb = bench_sub.add_parser("lsp", help="the language server's own time per completion")
    lspb.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    lspb.add_argument("--file", help="the file to type (default: a held-out stdlib module)")
    lspb.add_argument("--keystrokes", type=int, default=100)
    lspb.add_argument("--json", help="write the results to this file")
    lspb.set_defaults(func=cmd_bench_lsp)
    dv = bench_sub.add_parser("draft-vocab", help="the share of your code's tokens the "
                              "drafts' reduced vocabulary holds, by language and size")
    dv.add_argument("--model", help="checkpoint directory or Hugging Face name (default: "
                    "the config file's, $AHEAD_MODEL, else the bundled model)")
    dv.add_argument("--files", nargs="+", default=["."],
                    help="files, and directories searched for source files (default: .)")
    dv.add_argument("--sizes", default="16384,32768",
                    help="reduced vocabulary sizes, comma-separated (default 16384,32768)")
    dv.add_argument("--chars", type=int, default=400_000,
                    help="characters read per language at most (default 400000)")
    dv.add_argument("--json", help="write the results to this file")
    dv.set_defaults(func=cmd_bench_draft_vocab)
    dp = bench_sub.add_parser("draft-pick", help="what the greedy drafts' coarse pass costs "
                              "in acceptance, by candidate tiles, on your code")
    dp.add_argument("--model", help="checkpoint directory or Hugging Face name (default: "
                    "the config file's, $AHEAD_MODEL, else the bundled model)")
    dp.add_argument("--files", nargs="+", default=["."],
                    help="files, and directories searched for source files (default: .)")
    dp.add_argument("--tiles", default="0,16,64",
                    help="candidate tiles of 16 rows, comma-separated; 0: the int4 rows "
                    "score every draft (default 0,16,64)")
    dp.add_argument("--draft-vocab", type=int, default=32768,
                    help="rows of the reduced draft head (default 32768, the engine's)")
    dp.add_argument("--prompts", type=int, default=24, help="contexts (default 24)")
    dp.add_argument("--context", type=int, default=200, help="tokens a context (default 200)")
    dp.add_argument("--tokens", type=int, default=48,
                    help="tokens generated a context (default 48)")
    dp.add_argument("-k", type=int, default=3, help="drafts a step (default 3)")
    dp.add_argument("--json", help="write the results to this file")
    dp.set_defaults(func=cmd_bench_draft_pick)
    qual = bench_sub.add_parser("quality", help="would a person keep the suggestions: shown "
                                "rate, exact match, docstrings, against the threshold")
    add_model_args(qual)
    qual.add_argument("--files", nargs="+", help="code to sample cursors from (default: "
                      "held-out standard-library modules)")
    qual.add_argument("--num", type=int, default=120, help="cursor positions")
    qual.add_argument("--docs", type=int, default=40, help="docstrings")
    qual.add_argument("--seed", type=int, default=0)
    qual.add_argument("--max-tokens", type=int, default=48)
    qual.add_argument("--min-shown", type=float, default=0.5, help="the inline threshold is "
                      "the one with the best exact match of shown suggestions among those "
                      "showing at least this share")
    qual.add_argument("--outside", action="store_true", help="sample the code of installed "
                      "projects the bundled model never saw in training (pygls, watchfiles) "
                      "instead of --files")
    qual.add_argument("--min-written", type=float, default=0.2, help="the docstring threshold "
                      "is the lowest with no junk among those writing at least this share "
                      "(none qualifies: the hook writes none with this model)")
    qual.add_argument("--save", action="store_true", help="keep the chosen thresholds with the "
                      "model (quality.json in its directory): the docstring hook's default")
    qual.add_argument("--json", help="write the results to this file")
    qual.add_argument("--plot", help="write a PNG of quality against the threshold here")
    qual.set_defaults(func=cmd_bench_quality)

    tr = sub.add_parser("train", help="train the bundled code model (resumes from OUT)")
    tr.add_argument("--out", default="runs/ahead-small", help="run directory")
    tr.add_argument("--preset", default="ahead-small")
    tr.add_argument("--steps", type=int, default=6000)
    tr.add_argument("--batch-size", type=int, default=8)
    tr.add_argument("--seq-len", type=int, default=256)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--corpus-mb", type=float, default=60.0, help="corpus size cap")
    tr.add_argument("--save-every", type=int, default=200)
    tr.add_argument("--fim-rate", type=float, default=0.5,
                    help="share of samples in fill-in-the-middle form")
    tr.add_argument("--spm-rate", type=float, default=0.5, help="share of the FIM samples in "
                    "suffix-prefix-middle order (then the model's prompts use that order)")
    tr.add_argument("--head-steps", type=int, default=0,
                    help="then train the MTP module alone as decoding chains it")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", help="default: cuda if available")
    tr.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    tr.add_argument("--install", action="store_true",
                    help="copy the trained model into the package as the bundled model")
    tr.add_argument("--heads-only", action="store_true", help="train new MTP modules for the "
                    "frozen model given by --model, saved beside it as mtp-heads.safetensors")
    tr.add_argument("--model", help="with --heads-only: the model directory")
    tr.set_defaults(func=cmd_train)

    daemon_cmds.add_parsers(sub)
    lsp = sub.add_parser("lsp", help="the language server editors start (stdio)")
    lsp.set_defaults(func=cmd_lsp)

    doc = sub.add_parser("docstrings", help="add docstrings the model writes to Python "
                         "functions and classes lacking one (exit 1 when a file changed)")
    doc.add_argument("files", nargs="+", metavar="FILE", help="Python files to edit in place")
    add_model_args(doc)
    doc.add_argument("--max-tokens", type=int, default=48, help="most tokens per docstring")
    doc.add_argument("--check", action="store_true",
                     help="only report what would change; files are left as they are")
    doc.add_argument("--no-daemon", action="store_true",
                     help="run the model in this process instead of through the daemon")
    doc.add_argument("--min-confidence", type=float, help="the confidence a docstring needs "
                     "to be written (default: the config's docstring_min_confidence, else the "
                     "model's own from `ahead bench quality --save`, else 0.25; 0: any)")
    doc.set_defaults(func=cmd_docstrings)

    mods = sub.add_parser("models", help="the checkpoints ahead can run (the bundled model, "
                          "the Hugging Face cache, DIRs) and how: family, parameters, MTP, "
                          "device, dtype, memory; or why not")
    mods.add_argument("dirs", nargs="*", metavar="DIR",
                      help="a model directory, or a directory of them")
    add_model_args(mods)
    mods.add_argument("--json", action="store_true", help="print JSON")
    mods.set_defaults(func=cmd_models)

    doctor = sub.add_parser("doctor", help="what to check when something is off: torch and "
                            "the device, the compiler, the daemon's directories and socket, the "
                            "config, the editors' command, the model, the HTTP endpoint")
    doctor.add_argument("--model", help="the model to check (default: as `ahead serve` picks)")
    doctor.set_defaults(func=cmd_doctor)

    new = sub.add_parser("new-model", help="write a small synthetic checkpoint (for trying "
                         "ahead and for tests; random or briefly trained weights); a Gemma 4 "
                         "preset (tiny-gemma4) also writes its assistant to DIR-assistant")
    new.add_argument("dir")
    new.add_argument("--preset", default="tiny-qwen3")
    new.add_argument("--train-steps", type=int, default=0)
    new.add_argument("--naming", choices=["deepseek", "mimo", "mtp"], default="deepseek")
    new.add_argument("--seed", type=int, default=0)
    new.add_argument("--force", action="store_true", help="write into a non-empty directory")
    new.set_defaults(func=cmd_new_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("\nahead: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`ahead status | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CliError as e:
        print(f"ahead: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except (ValueError, OSError) as e:  # bad checkpoints, configs, tokenizers, prompts
        print(f"ahead: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
