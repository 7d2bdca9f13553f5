from django.contrib import admin

from resources.models import GPU, Host, InstanceGroup, ResourceGroup


class GPUInline(admin.TabularInline):
    model = GPU
    extra = 0
    readonly_fields = ["uuid", "model", "memory_mb", "memory_used_mb", "utilization", "updated"]


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ["name", "address", "state", "cpu_slots", "last_heartbeat"]
    list_filter = ["state"]
    search_fields = ["name", "address"]
    inlines = [GPUInline]


@admin.register(ResourceGroup)
class ResourceGroupAdmin(admin.ModelAdmin):
    list_display = ["name", "slot_formula", "selection"]
    filter_horizontal = ["hosts"]


@admin.register(InstanceGroup)
class InstanceGroupAdmin(admin.ModelAdmin):
    list_display = ["name", "resource_group", "policy", "preemption", "share_weight",
                    "reclaim_grace_s"]
    list_filter = ["policy", "preemption"]
