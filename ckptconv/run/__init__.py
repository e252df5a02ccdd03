"""Running a job: runner.py (plan, run the units in one driver, finish inside the atomic output;
verify's stages), tasks.py (a unit of the plan as a task any process can run from the typed
request), executors.py (what runs the tasks: `local`, --workers N on this host), ray_executor.py
(`ray`, --ray: the tasks on a Ray cluster, imported when asked for), share.py (the one balancer:
which share does which unit, by bytes). The processes of a --distributed verify --device are
verify's own (jobs/verify/cluster.py)."""
