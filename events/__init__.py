"""The one event pipeline from the runtime, the host agents and the scheduler to the console.

Runtime processes, host agents and the scheduler append JSON events to the Redis stream
``edt:events`` (``XADD <stream> * data <json>``)::

    {"type": str, "job_id": int | str, "source": "driver" | "worker:<id>" | "scheduler"
     | "agent:<host>" | "console", "ts": <unix seconds, float>, ...fields}

The runtime's types and fields are documented in ``runtime/events.py``. Allocation changes are
the types starting with ``slot.`` (``slot.granted``, ``slot.reclaim_requested``,
``slot.released``, from the scheduler and the host agents) or ``allocation.`` (the same changes
under a second set of names, ``allocation.grant``, ``allocation.reclaim`` ..., which the console
understands as well), plus ``job.target``, with ``host``, ``slot`` and a ``message`` where they
have one. The scheduler's carry ``reason``: why, in the job owner's words (``scheduler.reasons``),
also on ``job.preempted`` and on ``job.waiting`` (a waiting job's reason, when it changes).
For these, and for ``job.*`` events, the browsers also get the job's slot count (``slots``) and
the instance group's totals (``cluster``), read from the database when the event is ingested, so
a page that missed an event is right again at the next one.

The modules, in the order an event goes through them:

- ``config/event_stream.py`` (below every service, so the scheduler, the agents, the console and
  the ``jobs`` services all publish the same way): the stream's name and
  :func:`config.event_stream.publish`, which Django-side code calls to append an event.
- ``management/commands/run_events``: the event consumer process; it reads the stream as a
  consumer group, hands each batch to ingest, and trims what it has read.
- ``ingest``: :func:`events.ingest.ingest_many`, the only place that turns an event into
  database rows, log lines and a Channels message. It drops what may not be stored and hands
  the rest to ``rows`` and ``fanout``.
- ``rows``: the rows an event leaves (``JobMetric``, ``JobEvent``, the job's epoch and
  iteration), with the one-line messages of ``describe``.
- ``logs``: the job's log file (``<result_dir>/log/console.jsonl``), appended by ingest and
  read by the console, always through ``jobs.jobfiles``.
- ``fanout``: the Channels groups (``job.<id>``, ``instance-group.<id>``), what the browsers
  get, and the background loop that sends it.

Ingest never changes a job's state or its ``SlotAllocation`` rows: the scheduler and the host
agents own those and publish events after they commit.

Who may say what: only the product publishes to the stream (host agents, the scheduler, the
console). A job's processes have no access to Redis; their events reach the stream through
their host agent (``agent.relay``), which sets ``job_id`` and ``source`` (``driver``,
``worker:<id>``) itself and passes only the runtime's types. Ingest holds the same line: an
event from any source but ``scheduler``, ``console`` or ``agent:<host>`` is stored only when
its type is one of the runtime's (``runtime.events.RUNTIME_TYPES``), so it can never stand
for an allocation or an agent's record such as ``driver.started``; and what ingest itself
adds for the browsers (``slots``, ``cluster``, ``owner_id``) is never taken from an event,
so no event shows other users a cluster or a job it made up.

Fair share: the relay holds each process of a job to a rate per kind of event (metrics and log
lines over it are dropped, and the job's log and page say so; every other type is only read
more slowly), and nothing trims the stream's unread entries: XADD trims only past
``EDT_EVENTS_STREAM_MAX``, a guard of Redis's memory, and ``run_events`` trims what every
consumer group has read and acknowledged. So one job's flood can cost others only time, never
their events, and while the stream is behind (``EDT_EVENTS_BACKLOG_HIGH``) every process is
held to a rate an honest job's events fit in (``agent.relay``).

Delivery is at least once, so ingest is idempotent: an event already stored (same job, type,
source and timestamp) is not stored twice, and a log line whose stream id is not newer than the
last one in the job's log file is not appended twice.
"""
