"""A trace-driven simulator of the scheduler: replays a workload against the real policy.

``traces`` reads an application's measured step times and steps to target (the Pollux OSDI'21
artifact's format); ``workload`` reads or makes the jobs; ``engine.Simulator`` runs one policy
over one workload in simulated time; ``report.summarize`` turns a run into the figures a team
compares (mean and p99 completion time, makespan, utilisation, finish-time fairness).
``bench/cluster.py`` runs it on the paper's workloads. Pure Python: no Django, no database.
"""
