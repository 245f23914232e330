"""Kascade top-k sparse attention: references, the portable XLA ops, public API."""
