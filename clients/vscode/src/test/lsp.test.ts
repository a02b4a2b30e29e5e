// `ahead lsp` driven by vscode-jsonrpc, the JSON-RPC library under VS Code's language client,
// with the initialization options the extension itself builds: a real server, a real daemon,
// the bundled model.
//
// The server command is $AHEAD_LSP_CMD (a JSON array ending in "lsp"), else the checkout's
// virtual environment. The daemon gets private runtime and state directories, and is stopped
// at the end (it outlives the server by design).

import { strict as assert } from "node:assert";
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { EventEmitter, once } from "node:events";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import * as path from "node:path";
import { pathToFileURL } from "node:url";
import { after, before, describe, it } from "node:test";

import {
  createMessageConnection,
  type MessageConnection,
  StreamMessageReader,
  StreamMessageWriter,
} from "vscode-jsonrpc/node";
// Types only: vscode-languageclient itself loads `vscode`, which exists inside VS Code alone.
import type {
  InitializeParams,
  InitializeResult,
  InlineCompletionItem,
  InlineCompletionList,
  InlineCompletionParams,
  Position,
  WorkDoneProgressBegin,
  WorkDoneProgressEnd,
} from "vscode-languageclient/node";

import { initializationOptions, readSettings } from "../options";

const REPO = path.resolve(__dirname, "..", "..", "..", "..");  // out/test -> the checkout
const START_S = 120;  // the first start loads the model on a small CPU
const ANSWER_S = 60;

const PY = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    ";
const PY_END: Position = { line: 5, character: 4 };

interface Status {
  state: string;
  message: string;
  model: string | null;
  daemon?: { counts: Record<string, number> } | null;
}

function serverCommand(): string[] {
  const fromEnv = process.env.AHEAD_LSP_CMD;
  const cmd: unknown = fromEnv
    ? JSON.parse(fromEnv)
    : [path.join(REPO, ".venv", "bin", "python"), "-m", "clients.cli", "lsp"];
  assert.ok(Array.isArray(cmd) && cmd.length > 0 && cmd.every((a) => typeof a === "string"),
            `AHEAD_LSP_CMD must be a JSON array of strings, not ${fromEnv}`);
  assert.equal(cmd.at(-1), "lsp", "the server command must end in `lsp`");
  return cmd;
}

/** `promise`, or a failure naming `what` after `seconds`. */
async function within<T>(promise: Promise<T>, seconds: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no ${what} within ${seconds} s`)), seconds * 1000);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/** The server process, its connection, and what it has said on its own. */
class Server {
  readonly statuses: Status[] = [];
  readonly progress: string[] = [];  // work-done progress kinds, in order
  readonly events = new EventEmitter();
  stderr = "";  // the end of it, for failure messages

  private constructor(readonly child: ChildProcess, readonly rpc: MessageConnection) {
    child.stderr?.on("data", (chunk: Buffer) => {
      this.stderr = (this.stderr + chunk).slice(-4000);
    });
    rpc.onNotification("ahead/didChangeStatus", (status: Status) => {
      this.statuses.push(status);
      this.events.emit("change");
    });
    rpc.onRequest("window/workDoneProgress/create", () => null);
    rpc.onNotification("$/progress", ({ value }: {
      value: WorkDoneProgressBegin | WorkDoneProgressEnd }) => {
      this.progress.push(value.kind);
      this.events.emit("change");
    });
    // A server that dies leaves requests unanswered; disposing rejects them at once.
    rpc.onClose(() => rpc.dispose());
    rpc.listen();
  }

  static async spawn(cmd: string[], env: NodeJS.ProcessEnv): Promise<Server> {
    const child = spawn(cmd[0], cmd.slice(1), { cwd: REPO, env, stdio: ["pipe", "pipe", "pipe"] });
    await once(child, "spawn");  // or the error, e.g. no such program
    const rpc = createMessageConnection(new StreamMessageReader(child.stdout!),
                                        new StreamMessageWriter(child.stdin!));
    return new Server(child, rpc);
  }

  /** Wait until `check` holds, re-checked at each status or progress notification. */
  async until(check: () => boolean, seconds: number, what: string): Promise<void> {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), seconds * 1000);
    const onExit = (): void => abort.abort();
    this.child.once("exit", onExit);
    try {
      while (!check()) {
        if (this.exited()) {
          abort.abort();
        }
        await once(this.events, "change", { signal: abort.signal });
      }
    } catch {
      const why = this.exited() ? `the server exited (${this.child.exitCode})`
        : `no ${what} within ${seconds} s`;
      throw new Error(`${why}; statuses ${JSON.stringify(this.statuses)}; ` +
                      `server stderr: ${this.stderr}`);
    } finally {
      clearTimeout(timer);
      this.child.off("exit", onExit);
    }
  }

  exited(): boolean {
    return this.child.exitCode !== null || this.child.signalCode !== null;
  }

  async close(): Promise<void> {
    if (!this.exited()) {
      const exited = once(this.child, "exit");
      try {
        await within(this.rpc.sendRequest("shutdown"), 10, "answer to shutdown");
        await this.rpc.sendNotification("exit");
        await within(exited, 10, "server exit");
      } catch {
        this.child.kill();
      }
    }
    this.rpc.dispose();
  }
}

describe("ahead lsp through vscode-jsonrpc", () => {
  const cmd = serverCommand();
  const tmp = mkdtempSync(path.join(tmpdir(), "ahead-vscode-"));
  const env = { ...process.env, AHEAD_RUNTIME_DIR: path.join(tmp, "rt"),
                AHEAD_STATE_DIR: path.join(tmp, "st") };
  const settings = readSettings((key) => ({
    model: path.join(REPO, "engine", "model_data"), maxTokens: 24, budgetMs: 20000,
  } as Record<string, unknown>)[key]);
  let server: Server;
  let init: InitializeResult;
  let item: InlineCompletionItem;

  const open = (name: string, languageId: string, text: string): string => {
    const uri = pathToFileURL(path.join(tmp, name)).href;
    void server.rpc.sendNotification("textDocument/didOpen", {
      textDocument: { uri, languageId, version: 1, text } });
    return uri;
  };
  const inline = (uri: string, position: Position) => {
    const params: InlineCompletionParams = {
      textDocument: { uri }, position, context: { triggerKind: 2 } };  // automatic
    return within(server.rpc.sendRequest<InlineCompletionList | InlineCompletionItem[] | null>(
      "textDocument/inlineCompletion", params), ANSWER_S, "inline completion");
  };

  before(async () => {
    server = await Server.spawn(cmd, env);
    const params: InitializeParams = {
      processId: process.pid,
      rootUri: null,
      capabilities: {
        general: { positionEncodings: ["utf-16"] },
        window: { workDoneProgress: true },
        textDocument: { inlineCompletion: {} },
      },
      initializationOptions: initializationOptions(settings),
    };
    try {
      init = await within(server.rpc.sendRequest<InitializeResult>("initialize", params),
                          START_S, "answer to initialize");
    } catch (e) {
      throw new Error(`${(e as Error).message}; server stderr: ${server.stderr}`);
    }
    await server.rpc.sendNotification("initialized", {});
    await server.until(() => server.statuses.at(-1)?.state === "ready", START_S, "ready status");
  }, { timeout: (START_S + 10) * 1000 });

  after(async () => {
    await server?.close();
    const stop = spawnSync(cmd[0], [...cmd.slice(1, -1), "stop"], {
      cwd: REPO, env, encoding: "utf-8", timeout: 60_000 });
    rmSync(tmp, { recursive: true, force: true });
    assert.equal(stop.status, 0, `stopping the daemon failed: ${stop.stderr}`);
  });

  it("offers inline completion and the accept command", () => {
    assert.ok(init.capabilities.inlineCompletionProvider);
    assert.deepEqual(init.capabilities.executeCommandProvider?.commands, ["ahead.accepted"]);
  });

  it("reports the daemon starting, then ready, with progress while it starts", async () => {
    await server.until(() => server.progress.includes("end"), ANSWER_S, "end of progress");
    assert.deepEqual(server.statuses.map((s) => s.state), ["starting", "ready"]);
    assert.deepEqual(server.progress, ["begin", "end"]);
    assert.ok(server.statuses[1].model, "the ready status names the model");
  });

  it("answers an inline completion at the end of a Python function", async () => {
    const answer = await inline(open("a.py", "python", PY), PY_END);
    assert.ok(answer, "the server answered null");
    const items = Array.isArray(answer) ? answer : answer.items;
    assert.ok(items.length > 0, "no items");
    item = items[0];
    assert.equal(typeof item.insertText, "string");
    const text = item.insertText as string;
    assert.ok(text.trim() !== "", `a blank suggestion: ${JSON.stringify(text)}`);
    assert.deepEqual(item.range, { start: PY_END, end: PY_END });
    assert.equal(item.command?.command, "ahead.accepted");
    assert.deepEqual(item.command?.arguments, [text.length]);
  });

  it("counts an accepted suggestion in the daemon's figures", async () => {
    assert.ok(item?.command, "needs the completion of the test before");
    await within(server.rpc.sendRequest("workspace/executeCommand", {
      command: item.command.command, arguments: item.command.arguments }), ANSWER_S,
                 "answer to workspace/executeCommand");
    const status = await within(server.rpc.sendRequest<Status>("ahead/status", {}), ANSWER_S,
                                "answer to ahead/status");
    assert.equal(status.state, "ready");
    assert.equal(status.daemon?.counts.accepted, 1);
  });

  it("answers null in a language the settings switch off", async () => {
    assert.equal(settings.enable.markdown, false, "markdown is off by default");
    const answer = await inline(open("a.md", "markdown", "# Title\n\nSome text "),
                                { line: 2, character: 10 });
    assert.equal(answer, null);
  });
});
