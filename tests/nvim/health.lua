-- :checkhealth ahead with the server command in $AHEAD_CMD; the report goes to $AHEAD_NVIM_OUT.
vim.opt.runtimepath:prepend(os.getenv("AHEAD_PLUGIN_DIR"))
require("ahead").setup({ cmd = { os.getenv("AHEAD_CMD"), "lsp" } })
vim.cmd("checkhealth ahead")
local f = assert(io.open(os.getenv("AHEAD_NVIM_OUT"), "w"))
f:write(table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), "\n"))
f:close()
vim.cmd("qall!")
