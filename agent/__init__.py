"""The host agent process: a Celery worker on its host's own queue that launches and watches
each job's driver and workers (``tasks`` -> ``driver_supervisor`` / ``worker_supervisor`` ->
``processes``), relays their events (``relay``) and keeps its host registered (``host``)."""
