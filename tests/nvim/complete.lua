-- Headless Neovim, its built-in LSP client, `ahead lsp`: attach to a real buffer and ask
-- for a completion at the end of it. Writes what came back to $AHEAD_NVIM_OUT and quits.
local out = os.getenv("AHEAD_NVIM_OUT")
local function finish(text)
  local f = assert(io.open(out, "w"))
  f:write(text)
  f:close()
  vim.cmd("qall!")
end

local lines = { "class Point:", "    def __init__(self, x, y):", "        self.x = x",
  "        self.y = " }
vim.api.nvim_buf_set_lines(0, 0, -1, false, lines)
vim.bo.filetype = "python"
vim.api.nvim_buf_set_name(0, os.getenv("AHEAD_NVIM_FILE"))

local client_id = vim.lsp.start_client({
  name = "ahead",
  cmd = { os.getenv("AHEAD_PYTHON"), "-m", "clients.cli", "lsp" },
  root_dir = vim.fn.getcwd(),
  init_options = { model = os.getenv("AHEAD_MODEL_DIR"), budgetMs = 20000, maxTokens = 24 },
  -- on_attach runs once the buffer has been sent (didOpen): ask then.
  on_attach = function(client)
    local params = {
      textDocument = { uri = vim.uri_from_bufnr(0) },
      position = { line = #lines - 1, character = #lines[#lines] },
      context = { triggerKind = 1 },
    }
    -- Neovim 0.7 has no inline-completion UI; the request itself is the same.
    client.request("textDocument/inlineCompletion", params, function(err, result)
      if err then
        finish("error: " .. vim.inspect(err))
      elseif result == nil or #result.items == 0 then
        finish("empty")
      else
        finish("ok:" .. result.items[1].insertText)
      end
    end, 0)
  end,
})
vim.lsp.buf_attach_client(0, client_id)
vim.defer_fn(function() finish("timeout") end, 120000)
