"""Built-in tools: calculator (exact arithmetic by parsing) and python (a sandboxed subprocess)."""

from minirl import hookimpl


@hookimpl
def minirl_tools():
    """calculator and python, by the class_name a tool config entry gives."""
    from minirl_plugins.tools.calculator import Calculator
    from minirl_plugins.tools.python_exec import PythonTool

    return {"calculator": Calculator, "python": PythonTool}
