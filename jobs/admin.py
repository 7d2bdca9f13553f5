from django.contrib import admin

from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob


class SlotAllocationInline(admin.TabularInline):
    model = SlotAllocation
    extra = 0
    can_delete = False
    readonly_fields = [
        "host",
        "gpu",
        "slot",
        "worker_id",
        "granted_at",
        "reclaim_requested_at",
        "released_at",
        "release_reason",
    ]


@admin.register(TrainingJob)
class TrainingJobAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "name",
        "owner",
        "state",
        "priority",
        "max_workers",
        "target_workers",
        "created",
    ]
    list_filter = ["state", "instance_group"]
    search_fields = ["name"]
    # The state machine owns `state`: change it through the services, not this form.
    readonly_fields = ["state", "started", "finished", "attempt", "restarts", "heartbeat"]
    inlines = [SlotAllocationInline]


@admin.register(JobEvent)
class JobEventAdmin(admin.ModelAdmin):
    list_display = ["job", "type", "source", "ts"]
    list_filter = ["type"]


@admin.register(JobMetric)
class JobMetricAdmin(admin.ModelAdmin):
    list_display = ["job", "kind", "epoch", "iteration", "workers", "ts"]
