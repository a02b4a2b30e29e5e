// The settings -> server mapping, without a server.

import { strict as assert } from "node:assert";
import { readFileSync } from "node:fs";
import * as path from "node:path";
import { describe, it } from "node:test";

import {
  DEFAULTS,
  documentSelector,
  initializationOptions,
  needsRestart,
  readSettings,
  serverCommand,
} from "../options";

const settingsOf = (values: Record<string, unknown>) => readSettings((key) => values[key]);

describe("options", () => {
  it("has the defaults package.json declares", () => {
    const manifest = JSON.parse(readFileSync(path.join(__dirname, "..", "..", "package.json"),
                                             "utf-8"));
    const properties = manifest.contributes.configuration.properties;
    for (const [key, value] of Object.entries(DEFAULTS)) {
      assert.deepEqual(properties[`ahead.${key}`]?.default, value, `ahead.${key}`);
    }
    assert.equal(Object.keys(properties).length, Object.keys(DEFAULTS).length);
  });

  it("falls back to the defaults for values of the wrong kind", () => {
    const settings = settingsOf({ serverPath: " ", serverArgs: "-m", maxTokens: 2.5,
                                  budgetMs: -1, enable: ["python"], model: 3 });
    assert.deepEqual(settings, { ...DEFAULTS, enable: { ...DEFAULTS.enable } });
  });

  it("maps settings to the command line and initialization options", () => {
    const settings = settingsOf({ serverPath: "/venv/bin/python",
                                  serverArgs: ["-m", "clients.cli"], model: "/ckpt",
                                  maxTokens: 24, budgetMs: 500, enable: { go: false } });
    assert.deepEqual(serverCommand(settings),
                     { command: "/venv/bin/python", args: ["-m", "clients.cli", "lsp"] });
    assert.deepEqual(initializationOptions(settings),
                     { model: "/ckpt", maxTokens: 24, budgetMs: 500, enable: { go: false } });
    assert.ok(!("model" in initializationOptions(settingsOf({}))), "no model: the bundled one");
  });

  it("selects every file unless '*' is off, then the languages switched on", () => {
    assert.deepEqual(documentSelector(DEFAULTS.enable),
                     [{ scheme: "file" }, { scheme: "untitled" }]);
    assert.deepEqual(documentSelector({ "*": false, rust: true, go: true, c: false }), [
      { scheme: "file", language: "go" }, { scheme: "untitled", language: "go" },
      { scheme: "file", language: "rust" }, { scheme: "untitled", language: "rust" },
    ]);
    assert.deepEqual(documentSelector({ "*": false }), []);
  });

  it("restarts the server only for a new command, model or selector", () => {
    const base = settingsOf({});
    assert.ok(!needsRestart(base, settingsOf({ maxTokens: 8, budgetMs: 100 })));
    assert.ok(!needsRestart(base, settingsOf({ enable: { "*": true, python: false } })));
    assert.ok(needsRestart(base, settingsOf({ model: "/ckpt" })));
    assert.ok(needsRestart(base, settingsOf({ serverArgs: ["-m", "clients.cli"] })));
    assert.ok(needsRestart(base, settingsOf({ enable: { "*": false, python: true } })));
  });
});
