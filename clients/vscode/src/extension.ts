// The VS Code side of ahead: starts `ahead lsp` over stdio, shows the model daemon's state in
// the status bar and offers a few commands. Inline completions, and the `ahead.accepted`
// command their items carry, are registered by vscode-languageclient itself (the server lists
// the command under executeCommandProvider), so accepted suggestions reach the daemon's counts.

import * as vscode from "vscode";
import {
  DidChangeConfigurationNotification,
  LanguageClient,
  State,
  TransportKind,
} from "vscode-languageclient/node";

import {
  documentSelector,
  initializationOptions,
  isEnabled,
  needsRestart,
  readSettings,
  serverCommand,
  type Settings,
} from "./options";

const STATUS_NOTIFICATION = "ahead/didChangeStatus";
const STATUS_REQUEST = "ahead/status";

/** What the server reports (`daemon` only in answers to ahead/status); "off" is ours, for
 * when no language is switched on and no server runs. */
interface Status {
  state: "starting" | "ready" | "down" | "off";
  message: string;
  model: string | null;
  daemon?: Record<string, unknown> | null;
}

const ICONS: Record<Status["state"], string> = {
  starting: "$(loading~spin)",
  ready: "$(check)",
  down: "$(warning)",
  off: "$(circle-slash)",
};

function currentSettings(): Settings {
  const config = vscode.workspace.getConfiguration("ahead");
  return readSettings((key) => config.get(key));
}

class StatusBar implements vscode.Disposable {
  private readonly item = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);

  constructor() {
    this.item.name = "ahead";
    this.item.command = "ahead.showStatus";
  }

  show(status: Status): void {
    this.item.text = `${ICONS[status.state]} ahead`;
    this.item.tooltip = [status.message, status.model ? `model: ${status.model}` : ""]
      .filter(Boolean).join("\n");
    this.item.backgroundColor = status.state === "down"
      ? new vscode.ThemeColor("statusBarItem.warningBackground") : undefined;
    this.item.show();
  }

  dispose(): void {
    this.item.dispose();
  }
}

/** One language client at a time; restarts are queued so that two never overlap. */
class Session {
  private client: LanguageClient | undefined;
  private settings = currentSettings();
  private status: Status = { state: "starting", message: "", model: null };
  private queue: Promise<void> = Promise.resolve();

  constructor(private readonly output: vscode.LogOutputChannel, private readonly bar: StatusBar) {}

  start(): Promise<void> {
    return this.enqueue(() => this.launch());
  }

  restart(): Promise<void> {
    return this.enqueue(async () => {
      await this.shutdown();
      await this.launch();
    });
  }

  stop(): Promise<void> {
    return this.enqueue(() => this.shutdown());
  }

  /** A change to `ahead.*`: a new server when the command, model or selector changed,
   * otherwise the new options are sent to the running one. */
  configurationChanged(): Promise<void> {
    const next = currentSettings();
    if (needsRestart(this.settings, next)) {
      return this.restart();
    }
    this.settings = next;
    const client = this.client;
    if (!client?.isRunning()) {
      return Promise.resolve();  // the next start reads the settings anew
    }
    return client.sendNotification(DidChangeConfigurationNotification.type,
                                   { settings: { ahead: initializationOptions(next) } });
  }

  async showStatus(): Promise<void> {
    let status = this.status;
    if (this.client?.isRunning()) {
      try {
        // Params are optional in JSON-RPC, but pygls drops a request without them.
        status = await this.client.sendRequest<Status>(STATUS_REQUEST, {});
      } catch (e) {
        status = { ...status, message: `${status.message} (ahead/status failed: ${e})` };
      }
    }
    this.output.appendLine(describe(status));
    this.output.show(true);
  }

  private enqueue(work: () => Promise<void>): Promise<void> {
    this.queue = this.queue.then(work, work);
    return this.queue;
  }

  private async launch(): Promise<void> {
    this.settings = currentSettings();
    const selector = documentSelector(this.settings.enable);
    if (selector.length === 0) {
      this.report({ state: "off", message: "no language is switched on (ahead.enable)",
                    model: null });
      return;
    }
    const { command, args } = serverCommand(this.settings);
    const client = new LanguageClient("ahead", "ahead", { command, args,
                                                          transport: TransportKind.stdio }, {
      documentSelector: selector,
      outputChannel: this.output,
      initializationOptions: () => initializationOptions(this.settings),
    });
    client.onNotification(STATUS_NOTIFICATION, (status: Status) => this.report(status));
    client.onDidChangeState(({ newState }) => {
      if (newState === State.Stopped && this.client === client) {
        this.report({ ...this.status, state: "down", message: "the language server stopped" });
      }
    });
    this.client = client;
    this.report({ state: "starting", message: `starting ${[command, ...args].join(" ")}`,
                  model: null });
    try {
      await client.start();
    } catch (e) {
      this.report({ state: "down", message: `could not start the language server: ${e}`,
                    model: null });
    }
  }

  private async shutdown(): Promise<void> {
    const client = this.client;
    this.client = undefined;
    try {
      await client?.dispose(2000);
    } catch (e) {
      this.output.appendLine(`ahead: stopping the language server: ${e}`);
    }
  }

  private report(status: Status): void {
    this.status = status;
    this.bar.show(status);
  }
}

function describe(status: Status): string {
  const lines = [`ahead: ${status.state}: ${status.message}`, `model: ${status.model ?? "-"}`];
  if (status.daemon) {
    lines.push(`daemon: ${JSON.stringify(status.daemon, null, 2)}`);
  }
  return lines.join("\n");
}

/** Flip completions for the active editor's language, in the settings scope that decides it. */
async function toggleLanguage(): Promise<void> {
  const language = vscode.window.activeTextEditor?.document.languageId;
  if (!language) {
    void vscode.window.showInformationMessage("ahead: no editor is active");
    return;
  }
  const config = vscode.workspace.getConfiguration("ahead");
  const on = !isEnabled(readSettings((key) => config.get(key)).enable, language);
  const own = config.inspect<Record<string, boolean>>("enable");
  const target = own?.workspaceValue && language in own.workspaceValue
    ? vscode.ConfigurationTarget.Workspace : vscode.ConfigurationTarget.Global;
  const base = target === vscode.ConfigurationTarget.Workspace
    ? own?.workspaceValue : own?.globalValue;
  await config.update("enable", { ...base, [language]: on }, target);
  void vscode.window.showInformationMessage(
    `ahead: completions ${on ? "on" : "off"} for ${language}`);
}

// deactivate() has no other way to reach the session, and VS Code awaits only its promise.
let session: Session | undefined;

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  const output = vscode.window.createOutputChannel("ahead", { log: true });
  const bar = new StatusBar();
  session = new Session(output, bar);
  const current = session;
  context.subscriptions.push(
    output,
    bar,
    vscode.commands.registerCommand("ahead.showStatus", () => current.showStatus()),
    vscode.commands.registerCommand("ahead.restart", () => current.restart()),
    vscode.commands.registerCommand("ahead.toggle", toggleLanguage),
    vscode.workspace.onDidChangeConfiguration((event) => {
      if (event.affectsConfiguration("ahead")) {
        void current.configurationChanged();
      }
    }),
  );
  await current.start();
}

export function deactivate(): Promise<void> | undefined {
  return session?.stop();
}
