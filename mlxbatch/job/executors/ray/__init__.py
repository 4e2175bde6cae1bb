"""Engine actors on a Ray cluster: the driver (``executor``), the actor (``actor``), the cluster and its sizing
(``cluster``), the driver's books of its actors (``slots``), prefix-local units of a window (``partition``) and the
run's ``progress.json`` (``progress``). Only ``executor`` and ``cluster`` import Ray."""
