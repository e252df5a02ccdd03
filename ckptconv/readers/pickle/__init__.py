"""The pickle machinery every pickle-based reader shares: one allowlisting VM (unpickler.py) that
never imports or calls anything from a file, and the inert stand-ins for the torch and numpy
globals it accepts (torch_globals.py, numpy_globals.py). docs/security.md says what bounds it."""
