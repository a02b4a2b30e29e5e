-- :checkhealth ahead
local compat = require("ahead.compat")

local M = {}

local health = vim.health or require("health") -- 0.7 has only the latter
local start = health.start or health.report_start
local ok = health.ok or health.report_ok
local warn = health.warn or health.report_warn
local err = health.error or health.report_error
local info = health.info or health.report_info

function M.check()
  local ahead = require("ahead")
  start("ahead")
  local v = vim.version()
  local version = ("%d.%d.%d"):format(v.major, v.minor, v.patch)
  if compat.builtin_inline_completion then
    ok("Neovim " .. version .. ": Neovim's own inline completion is available")
  elseif compat.inline_virt_text then
    ok("Neovim " .. version .. ": ghost text as inline virtual text")
  else
    warn("Neovim " .. version .. ": no inline virtual text; the ghost text covers the rest of "
      .. "the cursor line (0.10+ draws it inline)")
  end
  if not ahead.configured then
    err('require("ahead").setup() has not been called')
    return
  end

  local cmd = ahead.config.cmd
  if vim.fn.executable(cmd[1]) ~= 1 then
    err(("the server command %q is not executable"):format(cmd[1]),
      { "set `cmd` in setup() to the full path, e.g. ~/src/ahead/.venv/bin/ahead" })
    return
  end
  ok("server command: " .. table.concat(cmd, " "))

  local client = compat.client()
  if client then
    ok(("language server running (client %d): %s, %s"):format(client.id, ahead.status.state,
      ahead.status.message or ""))
  else
    info("the language server starts with the first buffer of an enabled filetype")
  end

  -- The daemon, asked by the same program: `... lsp` becomes `... status --json`.
  if cmd[#cmd] == "lsp" then
    local status_cmd = vim.list_extend(vim.list_slice(cmd, 1, #cmd - 1), { "status", "--json" })
    local out = vim.fn.system(status_cmd)
    if vim.v.shell_error == 0 then
      local okjson, s = pcall(vim.json and vim.json.decode or vim.fn.json_decode, out)
      if okjson and type(s) == "table" then
        ok(("daemon pid %s serving %s, up %ss"):format(s.pid, s.model, s.uptime_s))
      else
        warn("the daemon answered something unexpected: " .. out)
      end
    else
      info("no daemon running: the language server starts one when it needs it")
    end
  end
end

return M
