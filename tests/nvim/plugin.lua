-- The Neovim plugin end to end, headless: setup{} starts `ahead lsp` for a Python buffer, a
-- suggestion appears as ghost text while in insert mode, a character typed along it trims it
-- without a new request, a word and then the rest are accepted into the buffer, and the
-- daemon counted the acceptances. Writes "ok" or what went wrong to $AHEAD_NVIM_OUT.
local out = os.getenv("AHEAD_NVIM_OUT")
local log = {}
local function say(fmt, ...)
  log[#log + 1] = fmt:format(...)
end
local finished = false
local function finish(result)
  if finished then
    return
  end
  finished = true
  local f = assert(io.open(out, "w"))
  f:write(result .. "\n" .. table.concat(log, "\n") .. "\n")
  f:close()
  vim.cmd("qall!")
end
local function check(ok, what)
  if not ok then
    finish("failed: " .. what)
  end
  return ok
end

vim.opt.runtimepath:prepend(os.getenv("AHEAD_PLUGIN_DIR"))
local ahead = require("ahead")
local suggest = require("ahead.suggest")
local builtin = os.getenv("AHEAD_NVIM_BUILTIN") == "1" -- Neovim's own inline completion
ahead.setup({
  cmd = { os.getenv("AHEAD_PYTHON"), "-m", "clients.cli", "lsp" },
  model = os.getenv("AHEAD_MODEL_DIR"),
  budget_ms = 20000,
  max_tokens = 24,
  builtin = builtin,
})

local lines = { "class Point:", "    def __init__(self, x, y):", "        self.x = x",
  "        self.y = " }
local buf = vim.api.nvim_get_current_buf()
vim.api.nvim_buf_set_lines(buf, 0, -1, false, lines)
vim.api.nvim_buf_set_name(buf, os.getenv("AHEAD_NVIM_FILE"))
vim.bo[buf].filetype = "python" -- FileType: the plugin attaches

local step, shown, requests, typed = "ready", nil, 0, ""
local function text()
  return table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), "\n")
end

vim.api.nvim_create_autocmd("User", { pattern = "AheadStatus", callback = function()
  say("status %s: %s", ahead.status.state, ahead.status.message)
  if ahead.status.state == "down" then
    finish("failed: the server is down: " .. ahead.status.message)
  elseif ahead.status.state == "ready" and step == "ready" then
    step = "suggestion"
    vim.api.nvim_input("GA") -- insert mode at the end of the last line: a request
  end
end })

vim.api.nvim_create_autocmd("User", { pattern = "AheadSuggestion", callback = function()
  if step == "suggestion" then
    shown = ahead.current(buf)
    local ns = builtin and vim.api.nvim_create_namespace("nvim.lsp.inline_completion")
      or suggest.namespace
    local marks = vim.api.nvim_buf_get_extmarks(buf, ns, 0, -1, { details = true })
    say("shown %q, %d extmark(s)", shown, #marks)
    if not check(shown and #marks == 1 and marks[1][4].virt_text, "no ghost text drawn") then
      return
    end
    requests = suggest.requests
    local first = shown:sub(1, 1)
    if #shown > 1 and first:match("[%w_ %.%(%)=+,:]") then
      step, typed = "typed", first
      vim.api.nvim_input(first) -- typed along the suggestion
    else
      step = "accept"
      vim.api.nvim_input("<M-Right>")
    end
  elseif step == "typed" then
    local now = ahead.current(buf)
    say("after typing %q: shown %q, requests %d -> %d", typed, now, requests, suggest.requests)
    -- Neovim's own inline completion asks again (the daemon answers from the typed text).
    if check(now == shown:sub(2), "typing along did not trim the suggestion")
      and check(builtin or suggest.requests == requests, "typing along sent a request") then
      step = "accept"
      vim.api.nvim_input("<M-Right>") -- a word
    end
  elseif step == "rest" then
    step = "accept"
    vim.api.nvim_input("<Tab>")
  end
end })

vim.api.nvim_create_autocmd("User", { pattern = "AheadAccept", callback = function()
  if step ~= "accept" then
    return
  end
  local rest, want = ahead.current(buf), table.concat(lines, "\n") .. shown
  say("accepted; buffer %q, still shown: %q", text(), rest)
  if text() == want then
    step = "status"
    vim.cmd("AheadStatus")
  elseif rest ~= nil then
    vim.api.nvim_input("<Tab>") -- the rest
  elseif builtin then
    step = "rest" -- Neovim's own inline completion asks again for the rest
  else
    check(false, ("buffer %q, wanted %q"):format(text(), want))
  end
end })

vim.api.nvim_create_autocmd("User", { pattern = "AheadStatusShown", callback = function()
  local counts = ahead.last_status.daemon and ahead.last_status.daemon.counts or {}
  say("daemon counts: %s", vim.inspect(counts))
  if check((counts.accepted or 0) >= 1, "the daemon counted no acceptance") then
    finish("ok")
  end
end })

vim.defer_fn(function() finish("timeout at step " .. step) end, 150000)
