"""minirl's built-in plugins, each registered exactly as a third-party plugin would be."""
