from django.contrib import admin

from datasets.models import Dataset


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "type", "train_path", "test_path", "created"]
    search_fields = ["name"]
