"""Kimi Delta Attention: references, gate, XLA chunked and recurrent paths, public API."""
