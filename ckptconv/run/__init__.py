"""Running a job on one process or several: runner.py (plan, share out, write, gather, finish
inside the atomic output; verify's stages), share.py (the one balancer: who does which unit, by
bytes), cluster.py (the processes of one job and how they agree) and wire.py (what crosses between
them)."""
