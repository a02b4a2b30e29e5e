"""The K policy's learning, kept across daemon restarts.

A daemon exits when idle and starts again on the next request; without this, every start
would draft from priors until it had seen a few hundred steps again. What the policy learned
about a model (`KPolicy.learned`: acceptance and calibration, not the machine's step costs)
is saved in the state dir under a fingerprint of the model's files, so a changed checkpoint
starts afresh, and read back when that model is loaded again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from daemon.paths import write_atomic
from engine import Engine

log = logging.getLogger("ahead.daemon")


def policy_file(state_dir: Path, model_dir: Path) -> Path:
    """Where the policy of the model in `model_dir`, as its files are now, is kept."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            st = f.stat()
            digest.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return state_dir / "policy" / f"{digest.hexdigest()[:20]}.json"


def restore(engine: Engine, state_dir: Path) -> bool:
    """Start the engine's policy from what was saved for its model; whether there was any.
    A damaged or foreign file is logged and left for the next save to replace."""
    if engine.model_dir is None:
        return False
    path = policy_file(state_dir, engine.model_dir)
    try:
        engine.policy.start_from(json.loads(path.read_text()))
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:  # json's errors are ValueErrors too
        log.warning("not starting from the saved K policy %s: %s", path, e)
        return False
    log.info("K policy: starting from what was learned before (%s)", path.name)
    return True


def save(engine: Engine, state_dir: Path) -> None:
    """Write the policy's learning atomically (a reader never sees half a file)."""
    if engine.model_dir is None:
        return
    path = policy_file(state_dir, engine.model_dir)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_atomic(path, json.dumps(engine.policy.learned()) + "\n")
