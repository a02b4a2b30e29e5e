"""Backends run the scheduler's jobs (`daemon.scheduler.Backend`): `local` (the engine on the
daemon's worker thread: `daemon.backends.local`) or `openai` (a remote OpenAI-compatible
server: `daemon.backends.openai`). The pipeline above them (supersede, typing through,
priorities, deadlines, statistics) is the same for both. Only the local backend imports
torch and the engine's model; a daemon in front of a remote server starts without them.
"""

from __future__ import annotations
