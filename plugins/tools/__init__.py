"""Built-in tools: calculator (exact arithmetic by parsing) and python (a sandboxed subprocess)."""
