"""What the config readers share (config.py and the family modules beside it): the error a
config.json that ahead cannot run raises, and the layer kinds as HF names them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config.json that ahead cannot run, with the reason and the file."""


FULL, LINEAR, SLIDING = "full_attention", "linear_attention", "sliding_attention"
