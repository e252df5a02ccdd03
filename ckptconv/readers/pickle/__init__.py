"""The pickle machinery every pickle-based reader shares: one allowlisting VM (vm.py; what it
accepts in policy.py, what it builds in standins.py; unpickler.py gathers their names) that never
imports or calls anything from a file, and the inert stand-ins for the torch and numpy globals it
accepts (torch_globals.py, numpy_globals.py). docs/security.md says what bounds it."""
