"""The model: config.json, checkpoint files, and the decoder trunk with its MTP modules."""
