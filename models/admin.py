from django.contrib import admin

from models.models import ModelDefinition


@admin.register(ModelDefinition)
class ModelDefinitionAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "framework", "engine", "dataset", "created"]
    search_fields = ["name"]
