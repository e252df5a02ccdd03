"""Running a job on one process or several: runner.py (plan, share out, write, gather, finish
inside the atomic output; verify's stages), tasks.py (a unit of the plan as a task any process can
run from the typed request), executors.py (what runs the tasks: `local`, --workers N), share.py (the one balancer: who does which unit, by
bytes), cluster.py (the processes of one job and how they agree) and wire.py (what crosses between
them)."""
