"""`ahead bench`: the engine, the daemon's pipeline and the language server, measured."""
