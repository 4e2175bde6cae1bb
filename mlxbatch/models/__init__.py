"""Model sources that work without a model hub: random-weight builders and the SmolLM2 alias."""
