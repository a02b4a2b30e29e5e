"""Models by name: `Qwen/Qwen3.5-2B` (or `Qwen/Qwen3.5-2B@<revision>`) in the Hugging Face
cache, offline. Nothing is ever downloaded: a model not in the cache is an error that says
where it was looked for. Imports no torch (clients resolve names before loading anything).

The cache's layout (huggingface_hub's): <cache>/models--<org>--<name>/refs/<ref> holds the
commit a branch or tag points at; snapshots/<commit>/ holds that commit's files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelNotFound(ValueError):
    """A model name that is not a directory and not in the Hugging Face cache."""


def hf_hub_cache(env: Mapping[str, str] = os.environ) -> Path:
    """The hub cache: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def is_model_name(text: str) -> bool:
    """Whether `text` reads as a hub name (org/name, optionally @revision)."""
    return bool(_NAME.match(text.split("@", 1)[0]))


def snapshot(name: str, *, revision: str | None = None, needs: str = "config.json",
             env: Mapping[str, str] = os.environ) -> Path:
    """The snapshot directory of `name` at `revision` (a branch, tag or commit; default the
    one in the name after `@`, else main) that has the file `needs`."""
    if "@" in name and revision is None:
        name, revision = name.split("@", 1)
    revision = revision or "main"
    if not _NAME.match(name):
        raise ModelNotFound(f"{name!r} is not a model name of the form org/name")
    cache = hf_hub_cache(env)
    return _in_repo(cache / ("models--" + name.replace("/", "--")), name, revision, needs, cache)


def _in_repo(repo: Path, name: str, revision: str, needs: str, cache: Path) -> Path:
    """The snapshot directory of a cached repo at `revision` that has the file `needs`."""
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    elif _COMMIT.match(revision):
        commit = revision
    else:
        raise ModelNotFound(_missing(name, revision, cache, repo, f"no {ref}"))
    found = repo / "snapshots" / commit
    if not (found / needs).is_file():
        raise ModelNotFound(_missing(name, revision, cache, repo, f"no {found / needs}"))
    return found


def _missing(name: str, revision: str, cache: Path, repo: Path, why: str) -> str:
    have = sorted(p.name for p in (repo / "refs").glob("*")) if repo.is_dir() else []
    known = f"; revisions there: {', '.join(have)}" if have else ""
    where = ("" if repo.is_dir() else
             f" (looked in {cache}: from HF_HUB_CACHE, else HF_HOME/hub, else "
             "~/.cache/huggingface/hub)")
    return (f"model {name!r} at revision {revision!r} is not in the Hugging Face cache{where}: "
            f"{why}{known}. ahead never downloads; fetch it with "
            f"`hf download {name}` (or pass a checkpoint directory)")


def resolve_model(model: str | Path, env: Mapping[str, str] = os.environ) -> Path:
    """A checkpoint directory from `model`: an existing directory as it is, else a hub name
    looked up in the cache (see `snapshot`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if not is_model_name(text) or text.startswith((".", "/", "~")):
        raise ModelNotFound(f"model directory {path} does not exist")
    return snapshot(text, env=env)


ASSISTANT_SUFFIX = "-assistant"  # Gemma 4's drafters: google/gemma-4-e2b-it-assistant


def assistant_for(model: str | Path, draft_model: str | Path | None = None,
                  env: Mapping[str, str] = os.environ) -> Path | None:
    """The draft model's checkpoint directory: `draft_model` (a directory or a name, which
    must be found), else `<model>-assistant` where it is beside the model in the HF cache
    (`model` a name, or a snapshot directory in the cache), else None."""
    if draft_model is not None:
        return resolve_model(draft_model, env)
    path = Path(model).expanduser()
    if path.is_dir():  # <cache>/models--org--name/snapshots/<commit>
        repo = path.parent.parent
        if path.parent.name != "snapshots" or not repo.name.startswith("models--"):
            return None
        cache = repo.parent
        repo = repo.with_name(repo.name + ASSISTANT_SUFFIX)
    else:
        name = str(model).split("@", 1)[0]
        if not is_model_name(name):
            return None
        cache = hf_hub_cache(env)
        repo = cache / ("models--" + name.replace("/", "--") + ASSISTANT_SUFFIX)
    try:
        return _in_repo(repo, repo.name, "main", "config.json", cache)
    except ModelNotFound:
        return None
