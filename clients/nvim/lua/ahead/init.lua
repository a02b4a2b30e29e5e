-- ahead for Neovim: starts `ahead lsp` for the buffers of enabled filetypes and shows its
-- inline completions as ghost text.
--
--   require("ahead").setup({ model = "~/models/my-coder", keys = { accept = "<C-l>" } })
--
-- On Neovim 0.12+ the suggestions are Neovim's own (vim.lsp.inline_completion); before that
-- this plugin requests and draws them itself (lua/ahead/suggest.lua).
local compat = require("ahead.compat")
local suggest = require("ahead.suggest")

local M = {}

local defaults = {
  cmd = { "ahead", "lsp" }, -- the language server (it starts the model daemon on demand)
  model = nil, -- a checkpoint directory for the daemon it starts (default: the bundled model)
  max_tokens = nil, -- longest suggestion, in tokens (server default 64)
  budget_ms = nil, -- give up on a suggestion after this long (server default 2000)
  enable = { ["*"] = true, markdown = false, text = false, gitcommit = false, help = false },
  debounce_ms = 20, -- pause in typing before asking (the server cancels stale work anyway)
  builtin = nil, -- use Neovim's own inline completion: nil = when there is one (0.12+)
  keys = { -- insert mode; false turns one off
    accept = "<Tab>", -- falls through to a plain <Tab> when nothing is shown
    accept_word = "<M-Right>",
    accept_line = "<M-C-Right>",
    next = "<M-]>",
    prev = "<M-[>",
    dismiss = "<C-]>",
  },
}

M.config = vim.deepcopy(defaults)
M.status = { state = "stopped", message = "not started" }

local function builtin()
  if M.config.builtin == nil then
    return compat.builtin_inline_completion
  end
  return M.config.builtin and compat.builtin_inline_completion
end

local function settings()
  local c = M.config
  return { model = c.model and vim.fn.expand(c.model) or nil, maxTokens = c.max_tokens,
    budgetMs = c.budget_ms, enable = c.enable }
end

local function enabled(bufnr)
  if vim.bo[bufnr].buftype ~= "" then
    return false
  end
  local ft, enable = vim.bo[bufnr].filetype, M.config.enable
  if ft == "" then
    return false
  end
  if enable[ft] ~= nil then
    return enable[ft]
  end
  return enable["*"] ~= false
end

local function on_status(_, result)
  if type(result) == "table" then
    M.status = result
    vim.api.nvim_exec_autocmds("User", { pattern = "AheadStatus", modeline = false })
  end
end

local function lsp_config()
  return {
    name = "ahead",
    cmd = M.config.cmd,
    root_dir = vim.fn.getcwd(),
    init_options = settings(),
    handlers = { ["ahead/didChangeStatus"] = on_status },
    on_exit = function(code)
      vim.schedule(function()
        M.status = { state = "down", message = "ahead lsp exited with code " .. code }
        vim.api.nvim_exec_autocmds("User", { pattern = "AheadStatus", modeline = false })
      end)
    end,
  }
end

local group = vim.api.nvim_create_augroup("ahead", { clear = true })

local function watch(bufnr)
  local debounce = M.config.debounce_ms
  vim.api.nvim_create_autocmd({ "TextChangedI", "CursorMovedI", "InsertEnter" }, {
    group = group, buffer = bufnr,
    callback = function() suggest.refresh(bufnr, debounce) end,
  })
  vim.api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, {
    group = group, buffer = bufnr, callback = function() suggest.clear(bufnr) end,
  })
  vim.api.nvim_create_autocmd("BufUnload", {
    group = group, buffer = bufnr, callback = function() suggest.detach(bufnr) end,
  })
end

--- Start the server for `bufnr` if its filetype is enabled (setup does this on FileType).
function M.attach(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if not enabled(bufnr) or vim.b[bufnr].ahead_attached then
    return
  end
  if M.status.state == "stopped" then
    M.status = { state = "starting", message = "starting ahead lsp" }
  end
  if compat.attach(lsp_config(), bufnr) == nil then
    M.status = { state = "down", message = "could not start " .. table.concat(M.config.cmd, " ") }
    return
  end
  vim.b[bufnr].ahead_attached = true
  if builtin() then
    vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
    -- The same User AheadSuggestion event as our own drawing gives, once Neovim has drawn.
    vim.api.nvim_create_autocmd("LspRequest", {
      group = group, buffer = bufnr,
      callback = function(args)
        local req = args.data and args.data.request
        if req and req.type == "complete" and req.method == "textDocument/inlineCompletion" then
          vim.schedule(function()
            if M.visible(bufnr) then
              vim.api.nvim_exec_autocmds("User", { pattern = "AheadSuggestion", modeline = false })
            end
          end)
        end
      end,
    })
  else
    watch(bufnr)
  end
end

-- The keys: each acts when a suggestion is shown and is the plain key otherwise.
local actions = {
  accept = function(b) return M.accept(b, "all") end,
  accept_word = function(b) return M.accept(b, "word") end,
  accept_line = function(b) return M.accept(b, "line") end,
  next = function(b) return M.cycle(b, 1) end,
  prev = function(b) return M.cycle(b, -1) end,
  dismiss = function(b) return M.dismiss(b) end,
}

local function map_keys()
  for name, key in pairs(M.config.keys) do
    if key and actions[name] then
      vim.keymap.set("i", key, function()
        local bufnr = vim.api.nvim_get_current_buf()
        if not vim.b[bufnr].ahead_attached or not M.visible(bufnr) then
          return key
        end
        -- Text cannot change inside an <expr> mapping: run the action just after it.
        return ("<Cmd>lua require('ahead')._key(%q)<CR>"):format(name)
      end, { expr = true, silent = true, desc = "ahead: " .. name:gsub("_", " ") })
    end
  end
end

function M._key(name)
  actions[name](vim.api.nvim_get_current_buf())
end

--- The suggestion on screen in `bufnr` (what accepting it all would insert), or nil.
function M.current(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if not builtin() then
    return suggest.current(bufnr)
  end
  local marks = vim.api.nvim_buf_get_extmarks(bufnr,
    vim.api.nvim_create_namespace("nvim.lsp.inline_completion"), 0, -1, { details = true })
  local details = marks[1] and marks[1][4]
  if not details or not details.virt_text then
    return nil
  end
  local lines = { details.virt_text[1][1] }
  for _, chunks in ipairs(details.virt_lines or {}) do
    lines[#lines + 1] = chunks[1] and chunks[1][1] or ""
  end
  return table.concat(lines, "\n")
end

function M.visible(bufnr)
  return M.current(bufnr) ~= nil
end

--- Take the suggestion: "all", or its next "word" or "line".
function M.accept(bufnr, unit)
  if not builtin() then
    return suggest.accept(bufnr, unit)
  end
  return vim.lsp.inline_completion.get({ bufnr = bufnr, on_accept = function(item)
    -- Our own insert, so that a part can be taken: the server then suggests the rest again,
    -- answered from the text just typed (no model work).
    local text = type(item.insert_text) == "string" and item.insert_text
      or item.insert_text.value
    local row, col = unpack(vim.api.nvim_win_get_cursor(0))
    if item.range then -- typed along since it was asked for: that part is there already
      local start_row, start_col = item.range:to_extmark() -- 0-based row, byte column
      local line = vim.api.nvim_buf_get_lines(bufnr, row - 1, row, false)[1]
      local typed = start_row == row - 1 and line:sub(start_col + 1, col) or ""
      if text:sub(1, #typed) == typed then
        text = text:sub(#typed + 1)
      end
    end
    suggest.insert(bufnr, suggest.take(text, unit))
    vim.api.nvim_exec_autocmds("User", { pattern = "AheadAccept", modeline = false })
  end })
end

function M.cycle(bufnr, step)
  if builtin() then
    return vim.lsp.inline_completion.select({ bufnr = bufnr, count = step })
  end
  return suggest.cycle(bufnr, step)
end

--- Hide the suggestion until the text changes.
function M.dismiss(bufnr)
  if not builtin() then
    return suggest.dismiss(bufnr)
  end
  -- Neovim's inline completion has no dismiss of its own: switch it off for this buffer
  -- until the next change.
  vim.lsp.inline_completion.enable(false, { bufnr = bufnr })
  vim.api.nvim_create_autocmd({ "TextChangedI", "InsertLeave" }, {
    group = group, buffer = bufnr, once = true,
    callback = function() vim.lsp.inline_completion.enable(true, { bufnr = bufnr }) end,
  })
end

--- A short state for a statusline: "ahead: ready".
function M.statusline()
  return "ahead: " .. (M.status.state or "?")
end

local function show_status()
  local lines = { ("ahead: %s (%s)"):format(M.status.state, M.status.message or "") }
  local client = compat.client()
  if client == nil then
    vim.notify(lines[1] .. "; no server running", vim.log.levels.INFO)
    return
  end
  compat.request(client, "ahead/status", {}, function(err, info)
    if err or type(info) ~= "table" then
      vim.notify(lines[1] .. "; the server did not answer: " .. vim.inspect(err),
        vim.log.levels.WARN)
      return
    end
    local d = type(info.daemon) == "table" and info.daemon or nil
    lines[1] = ("ahead: %s (%s)"):format(info.state, info.message)
    if d then
      local counts, lat = d.counts or {}, d.latency_ms or {}
      lines[#lines + 1] = ("model %s, daemon pid %s, up %ss"):format(d.model, d.pid, d.uptime_s)
      lines[#lines + 1] = ("completions %s, accepted %s, typed through %s, cancelled %s")
        :format(counts.completions or 0, counts.accepted or 0, counts.typed_through or 0,
          counts.cancelled or 0)
      if lat.p50 then
        lines[#lines + 1] = ("latency p50 %s ms, p90 %s ms"):format(lat.p50, lat.p90)
      end
    end
    M.last_status = info
    vim.notify(table.concat(lines, "\n"), vim.log.levels.INFO)
    vim.api.nvim_exec_autocmds("User", { pattern = "AheadStatusShown", modeline = false })
  end, vim.api.nvim_get_current_buf())
end

function M.setup(opts)
  local first = M.configured == nil
  M.config = vim.tbl_deep_extend("force", vim.deepcopy(defaults), opts or {})
  M.configured = true
  vim.api.nvim_set_hl(0, "AheadGhost", { link = "Comment", default = true })
  map_keys()
  vim.api.nvim_create_user_command("AheadStatus", show_status,
    { desc = "ahead: the daemon's state and figures" })
  if first then
    vim.api.nvim_create_autocmd("FileType", {
      group = group, callback = function(args) M.attach(args.buf) end,
    })
    for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
      if vim.api.nvim_buf_is_loaded(bufnr) then
        M.attach(bufnr)
      end
    end
  else
    local client = compat.client() -- settings changed: tell the running server
    if client then
      compat.notify(client, "workspace/didChangeConfiguration", { settings = { ahead = settings() } })
    end
  end
end

return M
