-- Ghost text for Neovim before 0.12: request textDocument/inlineCompletion as the user
-- types, draw the suggestion with extmarks, accept it whole or a word or a line at a time.
--
-- A suggestion is anchored where it was asked for; text typed along it only trims what is
-- shown (no request), anything else asks again after a short debounce. The server cancels
-- superseded work itself; cancelling here keeps stale answers off the screen.
local compat = require("ahead.compat")

local M = { requests = 0 } -- requests sent, for tests and :AheadStatus
local ns = vim.api.nvim_create_namespace("ahead")
local states = {} -- bufnr -> state
local uv = vim.loop

local function state(bufnr)
  local s = states[bufnr]
  if s == nil then
    s = { items = {}, index = 1 }
    states[bufnr] = s
  end
  return s
end

local function cursor()
  local pos = vim.api.nvim_win_get_cursor(0)
  return pos[1] - 1, pos[2]
end

local function line_at(bufnr, row)
  return vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
end

--- What is left to show: the current item less what has been typed along it, or nil.
local function remaining(bufnr, s)
  local item = s.items[s.index]
  if item == nil then
    return nil
  end
  local row, col = cursor()
  if row ~= item.row or col < item.col then
    return nil
  end
  local typed = line_at(bufnr, row):sub(item.col + 1, col)
  if item.text:sub(1, #typed) ~= typed or #typed >= #item.text then
    return nil
  end
  return item.text:sub(#typed + 1)
end

local function render(bufnr, text)
  vim.api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
  local row, col = cursor()
  local lines = vim.split(text, "\n", { plain = true })
  local virt_lines = {}
  for i = 2, #lines do
    virt_lines[#virt_lines + 1] = { { lines[i], "AheadGhost" } }
  end
  local opts = { virt_lines = #virt_lines > 0 and virt_lines or nil, hl_mode = "combine" }
  if compat.inline_virt_text then
    opts.virt_text, opts.virt_text_pos = { { lines[1], "AheadGhost" } }, "inline"
  else
    -- No inline virtual text before 0.10: draw over the rest of the line at the cursor's
    -- screen column, followed by what it covers, so the line reads as it would after
    -- accepting.
    local rest = line_at(bufnr, row):sub(col + 1)
    local view = vim.fn.winsaveview()
    opts.virt_text = { { lines[1], "AheadGhost" }, { rest, "Normal" } }
    opts.virt_text_win_col = vim.fn.virtcol({ row + 1, col + 1 }) - 1 - view.leftcol
    if #rest == 0 then
      opts.virt_text[2] = nil
    end
  end
  vim.api.nvim_buf_set_extmark(bufnr, ns, row, col, opts)
  vim.api.nvim_exec_autocmds("User", { pattern = "AheadSuggestion", modeline = false })
end

local function hide(bufnr)
  vim.api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
end

local function cancel(bufnr, s)
  if s.timer then
    s.timer:stop()
    s.timer:close()
    s.timer = nil
  end
  if s.request then
    local client = compat.client()
    if client then
      compat.cancel(client, s.request)
    end
    s.request = nil
  end
end

local function items_from(bufnr, client, result, row)
  local items = {}
  if type(result) ~= "table" then
    return items -- null: nothing to suggest here
  end
  for _, raw in ipairs(result.items or result) do
    local text = raw.insertText
    if type(text) == "table" then
      text = text.value -- a snippet: shown and inserted as plain text
    end
    if type(text) == "string" and text ~= "" then
      local start = raw.range and raw.range.start or nil
      local item_row = start and start.line or row
      local col = start and compat.to_byte(line_at(bufnr, item_row), start.character,
        client.offset_encoding) or select(2, cursor())
      items[#items + 1] = { row = item_row, col = col, text = text, command = raw.command }
    end
  end
  return items
end

--- Ask for a suggestion at the cursor now (kind 1: asked for; 2: as the user types).
function M.request(bufnr, kind)
  local s = state(bufnr)
  cancel(bufnr, s)
  local client = compat.client()
  if client == nil then
    return
  end
  local row, col = cursor()
  local line = line_at(bufnr, row)
  local params = {
    textDocument = { uri = vim.uri_from_bufnr(bufnr) },
    position = { line = row, character = compat.to_units(line, col, client.offset_encoding) },
    context = { triggerKind = kind or 2 },
  }
  M.requests = M.requests + 1
  local ok, id
  ok, id = compat.request(client, "textDocument/inlineCompletion", params, function(err, result)
    if s.request ~= id then
      return -- superseded
    end
    s.request = nil
    if err or vim.api.nvim_get_mode().mode:sub(1, 1) ~= "i" then
      return
    end
    s.items, s.index = items_from(bufnr, client, result, row), 1
    local text = remaining(bufnr, s)
    if text then
      s.seen = nil -- typed along while waiting: shown trimmed
      render(bufnr, text)
    else
      s.items = {}
    end
  end, bufnr)
  s.request = ok and id or nil
end

--- After each change or cursor move in insert mode: trim or ask again.
function M.refresh(bufnr, debounce_ms)
  local s = state(bufnr)
  local row, col = cursor()
  local key = vim.api.nvim_buf_get_changedtick(bufnr) .. ":" .. row .. ":" .. col
  if s.seen == key then
    return -- CursorMovedI and TextChangedI for the same keystroke
  end
  s.seen = key
  local text = remaining(bufnr, s)
  if text then
    render(bufnr, text)
    return
  end
  hide(bufnr)
  s.items = {}
  if s.dismissed == vim.api.nvim_buf_get_changedtick(bufnr) then
    return
  end
  cancel(bufnr, s)
  s.timer = uv.new_timer()
  s.timer:start(debounce_ms, 0, vim.schedule_wrap(function()
    if vim.api.nvim_get_current_buf() == bufnr and vim.fn.mode():sub(1, 1) == "i" then
      M.request(bufnr, 2)
    end
  end))
end

--- The text shown now, or nil.
function M.current(bufnr)
  return remaining(bufnr, state(bufnr))
end

--- The part of `text` one accept takes: all of it, its next word, or its next line.
function M.take(text, unit)
  if unit == "word" then
    return text:match("^[ \t]*[%w_]+") or text:match("^[ \t]*[^%w_%s]+")
      or text:match("^[ \t]*\n[ \t]*") or text
  elseif unit == "line" then
    return text:match("^\n?[^\n]+") or text:match("^\n") or text
  end
  return text
end

--- Insert `piece` at the cursor, leave the cursor after it, and tell the server how many
--- characters were taken (the daemon counts acceptances). Returns the end (row, col).
function M.insert(bufnr, piece)
  local row, col = cursor()
  local lines = vim.split(piece, "\n", { plain = true })
  vim.api.nvim_buf_set_text(bufnr, row, col, row, col, lines)
  local end_row = row + #lines - 1
  local end_col = (#lines == 1 and col or 0) + #lines[#lines]
  vim.api.nvim_win_set_cursor(0, { end_row + 1, end_col })
  local client = compat.client()
  if client then
    compat.request(client, "workspace/executeCommand",
      { command = "ahead.accepted", arguments = { vim.fn.strchars(piece) } },
      function() end, bufnr)
  end
  return end_row, end_col
end

--- Insert all of the suggestion, or its next word or line. False when there is none.
function M.accept(bufnr, unit)
  local s = state(bufnr)
  local text = remaining(bufnr, s)
  if text == nil then
    return false
  end
  local piece = M.take(text, unit)
  local end_row, end_col = M.insert(bufnr, piece)
  if #piece < #text then -- the rest stays on show, anchored after what was taken
    s.items, s.index = { { row = end_row, col = end_col, text = text:sub(#piece + 1) } }, 1
    render(bufnr, s.items[1].text)
  else
    s.items = {}
    hide(bufnr)
  end
  vim.api.nvim_exec_autocmds("User", { pattern = "AheadAccept", modeline = false })
  return true
end

--- Show the next (or previous) of several suggestions; asks for some when there are none.
function M.cycle(bufnr, step)
  local s = state(bufnr)
  if #s.items == 0 then
    M.request(bufnr, 1)
    return
  end
  s.index = (s.index - 1 + step) % #s.items + 1
  local text = remaining(bufnr, s)
  if text then
    render(bufnr, text)
  end
end

--- Hide the suggestion until the text changes.
function M.dismiss(bufnr)
  local s = state(bufnr)
  cancel(bufnr, s)
  s.items = {}
  s.dismissed = vim.api.nvim_buf_get_changedtick(bufnr)
  hide(bufnr)
end

--- Leaving insert mode or the buffer: nothing stays on screen or in flight.
function M.clear(bufnr)
  local s = state(bufnr)
  cancel(bufnr, s)
  s.items, s.seen, s.dismissed = {}, nil, nil
  hide(bufnr)
end

function M.detach(bufnr)
  if states[bufnr] then
    M.clear(bufnr)
    states[bufnr] = nil
  end
end

M.namespace = ns
return M
