-- What differs between the Neovim versions the plugin runs on (0.7 to 0.12+).
local M = {}

local function has(version)
  return vim.fn.has("nvim-" .. version) == 1
end

M.inline_virt_text = has("0.10") -- virt_text_pos = "inline"
M.builtin_inline_completion = has("0.12") and vim.lsp.inline_completion ~= nil
local new_index_api = has("0.11") -- vim.str_utfindex(s, encoding, index)

--- The position of byte `col` of `line` in the client's offset encoding.
function M.to_units(line, col, encoding)
  col = math.min(col, #line)
  if encoding == "utf-8" then
    return col
  elseif new_index_api then
    return vim.str_utfindex(line, encoding, col, false)
  end
  local utf32, utf16 = vim.str_utfindex(line, col)
  return encoding == "utf-16" and utf16 or utf32
end

--- The byte of `line` at `units` in the client's offset encoding (clamped to the line).
function M.to_byte(line, units, encoding)
  if encoding == "utf-8" then
    return math.min(units, #line)
  elseif new_index_api then
    return vim.str_byteindex(line, encoding, units, false)
  end
  local ok, byte = pcall(vim.str_byteindex, line, units, encoding == "utf-16")
  return ok and byte or #line
end

--- Start (or reuse) the one client and attach `bufnr` to it; returns the client id.
function M.attach(config, bufnr)
  if vim.lsp.start then -- 0.8+: reuses the client of the same name
    return vim.lsp.start(config, {
      bufnr = bufnr,
      reuse_client = function(client, conf) return client.name == conf.name end,
    })
  end
  local id = M.client_id
  if id == nil or vim.lsp.get_client_by_id(id) == nil then
    id = vim.lsp.start_client(config)
    M.client_id = id
  end
  if id then
    vim.lsp.buf_attach_client(bufnr, id)
  end
  return id
end

--- The running ahead client, if any.
function M.client()
  local clients = vim.lsp.get_clients and vim.lsp.get_clients({ name = "ahead" })
    or vim.tbl_filter(function(c) return c.name == "ahead" end, vim.lsp.get_active_clients())
  return clients[1]
end

-- Client methods: called as client:name(...) from 0.11 on (the field form is deprecated
-- there), as client.name(...) before.
local method_calls = has("0.11")
local function call(client, name, ...)
  if method_calls then
    return client[name](client, ...)
  end
  return client[name](...)
end

function M.request(client, method, params, handler, bufnr)
  return call(client, "request", method, params, handler, bufnr)
end

function M.cancel(client, id)
  return call(client, "cancel_request", id)
end

function M.notify(client, method, params)
  return call(client, "notify", method, params)
end

return M
