"""Live pages over WebSockets: one consumer per job page, one per instance group dashboard.

Both join Channels groups that ``events.ingest`` sends to. A user joins a job's group only
if ``visible_to`` lets them see the job; on a dashboard every signed-in user may watch the
cluster's totals, but the job-level details of a job they may not see are stripped before they
reach the browser.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from config.ownership import is_admin
from console import selectors
from events.fanout import instance_group_group, job_group
from jobs.models import TrainingJob
from resources.models import InstanceGroup

# Close codes the pages understand: 4401 = sign in again, 4403/4404 = stop retrying.
UNAUTHENTICATED = 4401
FORBIDDEN = 4403


def refresh_period(layer) -> float:
    """How often a live consumer renews its group memberships: well within the layer's
    ``group_expiry`` (``EDT_CHANNEL_GROUP_EXPIRY_S``), after which a member that stopped renewing
    (its web server was killed, so it never left) drops out of the group."""
    return max(0.5, getattr(layer, "group_expiry", 86400) / 4)


class _LiveConsumer(AsyncJsonWebsocketConsumer):
    groups_joined: list[str]

    async def connect(self) -> None:
        self.groups_joined = []
        self.user = self.scope.get("user")
        if not (self.user and self.user.is_authenticated):
            await self.close(code=UNAUTHENTICATED)
            return
        group = await self.authorised_group()
        if group is None:
            await self.close(code=FORBIDDEN)
            return
        await self.channel_layer.group_add(group, self.channel_name)
        self.groups_joined.append(group)
        await self.joined()
        self.renewal = asyncio.create_task(self._stay_in_groups())
        await self.accept()

    async def _stay_in_groups(self) -> None:
        # A consumer that dies with its process never runs disconnect(): its membership is only
        # good until the group expiry, so a live one re-adds itself before then.
        period = refresh_period(self.channel_layer)
        while True:
            await asyncio.sleep(period)
            for group in self.groups_joined:
                await self.channel_layer.group_add(group, self.channel_name)

    async def disconnect(self, code: int) -> None:
        renewal = getattr(self, "renewal", None)
        if renewal is not None:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def dispatch(self, message: dict[str, Any]) -> None:
        # Channels runs close_old_connections() in a worker thread before every handler. Live
        # events touch no database, and that thread hop per event per socket was the largest
        # cost of the fan-out (bench/live.py); connect and disconnect still get it.
        if message["type"] == "edt.events":
            await self.edt_events(message)
        else:
            await super().dispatch(message)

    async def edt_events(self, message: dict[str, Any]) -> None:
        raise NotImplementedError

    async def joined(self) -> None:
        """Read what the consumer must know before it follows the group's events: called once
        it is in the group, so that no event falls between that reading and the first one."""

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # The pages only listen; a ping keeps proxies from closing an idle socket.
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def authorised_group(self) -> str | None:
        raise NotImplementedError

    async def send_events(self, events: list[dict[str, Any]]) -> None:
        """One frame per batch: a single event as itself, several as ``{"type": "batch"}``."""
        if len(events) == 1:
            await self.send_json(events[0])
        elif events:
            await self.send_json({"type": "batch", "events": events})


class JobConsumer(_LiveConsumer):
    """``/ws/jobs/<id>/``: every event of one job the user may see."""

    async def authorised_group(self) -> str | None:
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        visible = await database_sync_to_async(
            TrainingJob.objects.visible_to(self.user).filter(pk=job_id).exists
        )()
        return job_group(job_id) if visible else None

    async def edt_events(self, message: dict[str, Any]) -> None:
        await self.send_events([item["event"] for item in message["events"]])


class InstanceGroupConsumer(_LiveConsumer):
    """``/ws/instance-groups/<id>/``: allocation and state changes of the group's jobs."""

    async def authorised_group(self) -> str | None:
        self.group_id = self.scope["url_route"]["kwargs"]["group_id"]
        exists = await database_sync_to_async(
            InstanceGroup.objects.filter(pk=self.group_id).exists
        )()
        self.sees_all = is_admin(self.user)
        return instance_group_group(self.group_id) if exists else None

    async def joined(self) -> None:
        # Workers training in each job this viewer may not see: the page gets only their sum,
        # so the consumer keeps every job's part to work the sum out again when one changes.
        self.hidden_training: dict[int, int] = {}
        if not self.sees_all:
            self.hidden_training = await database_sync_to_async(
                selectors.hidden_workers_training
            )(instance_group_id=self.group_id, user=self.user)

    async def edt_events(self, message: dict[str, Any]) -> None:
        visible = []
        for item in message["events"]:
            event = item["event"]
            if self.sees_all or item.get("owner_id") == self.user.pk:
                visible.append(event)
            elif (totals := self._totals_of(event)) is not None:
                visible.append(totals)
        await self.send_events(visible)

    def _totals_of(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Another user's job's event as this viewer gets it: only the cluster's totals, the
        slots in use and the workers training in the jobs it may not see; None when the event
        changes neither."""
        totals: dict[str, Any] = {"type": "cluster.usage", "ts": event.get("ts")}
        if "cluster" in event:
            totals["cluster"] = event["cluster"]
        training = selectors.workers_training_after(event)
        job_id = event.get("job_id")
        if training is not None and self.hidden_training.get(job_id, 0) != training:
            if training:
                self.hidden_training[job_id] = training
            else:
                self.hidden_training.pop(job_id, None)  # ended jobs need no place here
            # Absolute, like the slot counts: a page that applies it twice still shows the same.
            totals["others_training"] = sum(self.hidden_training.values())
        return totals if len(totals) > 2 else None
