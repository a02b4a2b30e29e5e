"""Decoding: the prefill, draft and verify steps, sampling and acceptance, and the K policy."""
