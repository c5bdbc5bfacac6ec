"""eaglekit, installed from its wheel: the `eaglekit` and `eaglekit-torch` programs in bin/,
the Python tools in share/eaglekit/python, and `eaglekit demo` (docs/wheel.md). The console
commands are in eaglekit._launcher."""
