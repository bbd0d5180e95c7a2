"""Agent loops: many samples' multi-turn rollouts run concurrently over the engine's request level.

server.py drives the engine (one step at a time, while loops wait for it or for tools), loop.py
runs one agent loop per sample and turns its Trajectory into the batch, tools.py and parser.py
call the tools the model asks for. docs/agents.md has the user's view.
"""
