"""Built-in agent loops: single_turn (one model turn, the default) and tool_agent (docs/agents.md)."""
