"""Stand-in for the torch_memory_saver package, which SGLang's memory saver imports.

The real one pauses and resumes tagged CUDA allocations; the fake engine tracks the pause state
itself (tests/fakes/sglang/srt/managers/scheduler.py), so this module only has to exist.
"""
