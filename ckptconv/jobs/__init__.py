"""The commands' jobs, thin: each makes its requests into a recipe, picks an output layout
(layouts/) and runs it (run/): convert.py, reshard.py, plan.py, and verify/ (which layout an output
is, its checks in order, --against, --device)."""
