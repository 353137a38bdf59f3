"""Test-only helpers that let vLLM's CPU build run adaptive verification."""
