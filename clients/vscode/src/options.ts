// The extension's settings and what they become for `ahead lsp`: the command line, the
// initialization options and the document selector. No `vscode` import, so the node tests
// run this very code against the real server.

/** The `ahead.*` settings, checked (settings.json can hold anything). */
export interface Settings {
  serverPath: string;
  serverArgs: string[];
  model: string; // "" for the bundled model
  maxTokens: number;
  budgetMs: number;
  enable: Record<string, boolean>; // language id -> on/off; "*" for the rest
}

// Kept equal to contributes.configuration in package.json (a test checks).
export const DEFAULTS: Readonly<Settings> = Object.freeze({
  serverPath: "ahead",
  serverArgs: [],
  model: "",
  maxTokens: 64,
  budgetMs: 2000,
  enable: { "*": true, plaintext: false, markdown: false, scminput: false },
});

/** Read the settings through `get` (a `WorkspaceConfiguration.get`), falling back to the
 * defaults for anything missing or of the wrong type. */
export function readSettings(get: (key: string) => unknown): Settings {
  const text = (key: keyof Settings, fallback: string): string => {
    const value = get(key);
    return typeof value === "string" && value.trim() !== "" ? value.trim() : fallback;
  };
  const positive = (key: keyof Settings, fallback: number): number => {
    const value = get(key);
    return Number.isInteger(value) && (value as number) > 0 ? (value as number) : fallback;
  };
  const args = get("serverArgs");
  const enable = get("enable");
  return {
    serverPath: text("serverPath", DEFAULTS.serverPath),
    serverArgs: Array.isArray(args) ? args.filter((a): a is string => typeof a === "string") : [],
    model: text("model", ""),
    maxTokens: positive("maxTokens", DEFAULTS.maxTokens),
    budgetMs: positive("budgetMs", DEFAULTS.budgetMs),
    enable: isRecord(enable) ? booleans(enable) : { ...DEFAULTS.enable },
  };
}

/** The program and arguments that start the language server. */
export function serverCommand(settings: Settings): { command: string; args: string[] } {
  return { command: settings.serverPath, args: [...settings.serverArgs, "lsp"] };
}

/** The initialization options `ahead lsp` reads; also sent, under `ahead`, with
 * workspace/didChangeConfiguration. Without `model` the server uses the bundled one. */
export function initializationOptions(settings: Settings): Record<string, unknown> {
  const options: Record<string, unknown> = {
    maxTokens: settings.maxTokens,
    budgetMs: settings.budgetMs,
    enable: settings.enable,
  };
  if (settings.model) {
    options.model = settings.model;
  }
  return options;
}

export function isEnabled(enable: Record<string, boolean>, language: string): boolean {
  return enable[language] ?? enable["*"] ?? true;
}

/** `enable` with `language` flipped. */
export function toggled(enable: Record<string, boolean>, language: string,
): Record<string, boolean> {
  return { ...enable, [language]: !isEnabled(enable, language) };
}

export interface DocumentFilter {
  scheme: string;
  language?: string;
}

// Files on disk and unsaved buffers; not diff views, output panes or the SCM input box.
const SCHEMES = ["file", "untitled"];

/** The documents the client syncs and asks completions for. A selector cannot exclude a
 * language, so with "*" on it takes every document and the server answers null for the
 * languages switched off; with "*" off it lists the languages switched on. */
export function documentSelector(enable: Record<string, boolean>): DocumentFilter[] {
  if (isEnabled(enable, "*")) {
    return SCHEMES.map((scheme) => ({ scheme }));
  }
  const languages = Object.keys(enable).filter((id) => id !== "*" && enable[id]).sort();
  return languages.flatMap((language) => SCHEMES.map((scheme) => ({ scheme, language })));
}

/** Whether going from `before` to `after` needs a new server process (a new command, a
 * new model for the daemon it starts, or a new document selector); the rest is sent as a
 * configuration change. */
export function needsRestart(before: Settings, after: Settings): boolean {
  const key = (s: Settings): string => JSON.stringify(
    [s.serverPath, s.serverArgs, s.model, documentSelector(s.enable)]);
  return key(before) !== key(after);
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function booleans(record: Record<string, unknown>): Record<string, boolean> {
  return Object.fromEntries(Object.entries(record).filter(([, v]) => typeof v === "boolean")) as
    Record<string, boolean>;
}
