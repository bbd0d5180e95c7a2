"""Built-in tools: calculator (exact arithmetic by parsing), python (a sandboxed subprocess) and
lookup (the synthetic tool task's per-row table)."""

from minirl import hookimpl


@hookimpl
def minirl_tools():
    """calculator, python and lookup, by the class_name a tool config entry gives."""
    from minirl_plugins.tools.calculator import Calculator
    from minirl_plugins.tools.lookup import Lookup
    from minirl_plugins.tools.python_exec import PythonTool

    return {"calculator": Calculator, "python": PythonTool, "lookup": Lookup}
