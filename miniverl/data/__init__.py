"""Prompt data: the built-in synthetic tasks and the prompt stream the controller draws from."""
