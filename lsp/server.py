"""`ahead lsp`: inline completions over the Language Server Protocol (stdio).

Thin handlers; the work lives in `lsp.completion` (context, daemon round trip, clean-up). It
imports no torch: the model lives in the daemon, started on demand.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import uuid
from typing import Any, BinaryIO

from lsprotocol import types
from pygls.io_ import StdoutWriter
from pygls.lsp.server import LanguageServer

from daemon.client import Client, DaemonUnavailable
from daemon.stats import percentiles
from lsp import rpc
from lsp.completion import Completer, Settings

log = logging.getLogger("ahead.lsp")

VERSION = "0.1.0"
ACCEPT_COMMAND = "ahead.accepted"
STATS_REQUEST = "ahead/stats"
STATUS_REQUEST = "ahead/status"  # -> Status, with the daemon's own figures when it is up
STATUS_NOTIFICATION = "ahead/didChangeStatus"  # Status, each time the state changes


class AheadServer(LanguageServer):
    def __init__(self, client: Client | None = None) -> None:
        super().__init__("ahead", VERSION, protocol_cls=rpc.Protocol)
        self.settings = Settings()
        self.completer = Completer(client or Client(client_name="ahead-lsp"), self.settings,
                                   session=uuid.uuid4().hex, report=self.set_state)
        # "starting" (the daemon is being reached or started, the model loading), "ready",
        # or "down"; editors show it in a status bar.
        self.state, self.message = "starting", "connecting to the model daemon"
        self._connecting: asyncio.Task[None] | None = None

    def start_io(self, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> None:
        """pygls' stdio server, with `lsp.rpc.serve` reading the messages."""
        protocol = self.protocol
        assert isinstance(protocol, rpc.Protocol)
        self._stop_event = threading.Event()
        protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        try:
            asyncio.run(rpc.serve(stdin or sys.stdin.buffer, protocol, self._stop_event,
                                  self.thread_pool))
        except BrokenPipeError:
            log.error("the client went away; shutting down")
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self.shutdown()

    def report_server_error(self, error: Exception, source: Any) -> None:
        """Logged, not shown: a request's error is in its response already, and a client
        sending bad notifications in a loop would otherwise get a popup for each."""
        log.warning("%s: %s", getattr(source, "__name__", source), error)

    def status(self) -> dict[str, Any]:
        welcome = self.completer.client.welcome
        return {"state": self.state, "message": self.message,
                "model": welcome.model if welcome is not None else None}

    def set_state(self, state: str, message: str) -> None:
        """Record the daemon's state; a change is sent to the client (and "down" is also
        said once as a message, not on every keystroke)."""
        if state == "ready" and not message:
            message = f"model ready: {self.status()['model']}"
        if state == self.state:
            self.message = message
            return
        if state == "down":
            self.window_show_message(types.ShowMessageParams(
                type=types.MessageType.Error, message=f"ahead: {message}"))
        self.state, self.message = state, message
        self.protocol.notify(STATUS_NOTIFICATION, self.status())

    async def start_daemon(self) -> None:
        """Connect (starting the daemon if need be), shown as work-done progress."""
        token, progress = "", self.work_done_progress
        window = self.client_capabilities.window
        if window is not None and window.work_done_progress:
            token = str(uuid.uuid4())
            await progress.create_async(token)
            progress.begin(token, types.WorkDoneProgressBegin(
                title="ahead", message="starting the model daemon"))
        self.protocol.notify(STATUS_NOTIFICATION, self.status())
        try:
            await self.completer.client.connect()
            self.set_state("ready", "")
        except Exception as e:  # any failure is reported; the server lives on
            self.set_state("down", f"the daemon is not available: {e}")
        if token:
            progress.end(token, types.WorkDoneProgressEnd(message=self.message))


server = AheadServer()


@server.feature(types.INITIALIZE)
def initialize(ls: AheadServer, params: types.InitializeParams) -> None:
    """Read the client's initialization options."""
    ls.settings.update(params.initialization_options)
    if ls.settings.model:  # for the daemon this server starts, if none is running
        ls.completer.client.serve_args = ["--model", ls.settings.model]


@server.feature(types.INITIALIZED)
def initialized(ls: AheadServer, params: types.InitializedParams) -> None:
    """Start the daemon early, so the first completion does not wait for the model."""
    ls._connecting = asyncio.ensure_future(ls.start_daemon())


@server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
def did_change_configuration(ls: AheadServer,
                             params: types.DidChangeConfigurationParams) -> None:
    """Apply settings sent by the client."""
    settings = params.settings
    if isinstance(settings, dict):
        ls.settings.update(settings.get("ahead", settings))


@server.feature(types.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: AheadServer, params: types.DidOpenTextDocumentParams) -> None:
    """Remember the file as context for completions in other files."""
    ls.completer.note(params.text_document.uri, params.text_document.text, None)


@server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: AheadServer, params: types.DidChangeTextDocumentParams) -> None:
    """Keep the context from this file fresh around the edit."""
    doc = ls.workspace.get_text_document(params.text_document.uri)
    change = params.content_changes[-1] if params.content_changes else None
    line = change.range.start.line if isinstance(
        change, types.TextDocumentContentChangePartial) else None
    ls.completer.note(doc.uri, doc.source, line)


@server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: AheadServer, params: types.DidCloseTextDocumentParams) -> None:
    """Forget a closed file's context."""
    ls.completer.forget(params.text_document.uri)


@server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
async def inline_completion(ls: AheadServer, params: types.InlineCompletionParams,
                            ) -> types.InlineCompletionList | None:
    """Suggest the code that follows the cursor, as ghost text."""
    found = await ls.completer.complete(ls.workspace, params.text_document.uri,
                                        params.position)
    if found is None:
        return None
    text, at = found
    item = types.InlineCompletionItem(insert_text=text, range=types.Range(start=at, end=at),
                                      command=_accepted(text))
    return types.InlineCompletionList(items=[item])


@server.feature(types.TEXT_DOCUMENT_COMPLETION)
async def completion(ls: AheadServer, params: types.CompletionParams,
                     ) -> types.CompletionList | None:
    """The same suggestion as a completion item, for clients without inline completion."""
    found = await ls.completer.complete(ls.workspace, params.text_document.uri,
                                        params.position)
    if found is None:
        return None
    text, at = found
    item = types.CompletionItem(
        label=text.splitlines()[0].strip() or text.strip(), kind=types.CompletionItemKind.Text,
        text_edit=types.TextEdit(range=types.Range(start=at, end=at), new_text=text),
        command=_accepted(text))
    return types.CompletionList(is_incomplete=True, items=[item])


def _accepted(text: str) -> types.Command:
    """The command a client runs when the suggestion is taken, so the daemon counts it."""
    return types.Command(title="accepted", command=ACCEPT_COMMAND, arguments=[len(text)])


@server.feature(STATS_REQUEST)
def stats(ls: AheadServer, params: Any) -> dict[str, Any]:
    """The server's own time per completion (not the daemon's), for `ahead bench lsp`."""
    c = ls.completer
    return {"overhead_ms": percentiles(list(c.overhead_ms)), "daemon_ms": list(c.daemon_ms)}


@server.feature(STATUS_REQUEST)
async def status(ls: AheadServer, params: Any) -> dict[str, Any]:
    """The state, and when the daemon is up its own figures (for `:AheadStatus` and the
    VS Code status bar's tooltip)."""
    info = ls.status()
    info["daemon"] = None
    if ls.state == "ready":
        try:
            info["daemon"] = await ls.completer.client.status()
        except DaemonUnavailable as e:
            ls.set_state("down", f"the daemon is not available: {e}")
            info = {**ls.status(), "daemon": None}
    return info


@server.command(ACCEPT_COMMAND)
async def accepted(ls: AheadServer, *args: Any) -> None:
    """A suggestion was accepted (fully, or in part: the number of characters taken)."""
    if len(args) == 1 and isinstance(args[0], list):  # the arguments as one list
        args = tuple(args[0])
    chars = args[0] if args and isinstance(args[0], int) else 0
    await ls.completer.accepted(chars)


def main() -> None:
    server.start_io()
