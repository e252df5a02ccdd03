"""Writer plugins (base.py: the interface and the registry)."""
