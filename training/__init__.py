"""`ahead train`: the bundled model's corpus, losses and recipes, and MTP heads for models
without them. Imports the engine; the engine never imports this."""
