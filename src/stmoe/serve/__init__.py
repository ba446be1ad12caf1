"""``stmoe serve``: an OpenAI-compatible server over an offloaded model (docs/serve.md)."""
