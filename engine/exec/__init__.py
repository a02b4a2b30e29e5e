"""How the step runs on the device: shapes that keep rows bit-identical, compiled and
captured variants of the step."""
