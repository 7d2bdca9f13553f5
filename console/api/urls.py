from django.urls import path
from rest_framework.routers import DefaultRouter

from console.api import hpo, views

router = DefaultRouter()
router.register("hosts", views.HostViewSet, basename="host")
router.register("resource-groups", views.ResourceGroupViewSet, basename="resourcegroup")
router.register("instance-groups", views.InstanceGroupViewSet, basename="instancegroup")
router.register("environments", views.EnvironmentViewSet, basename="environment")
router.register("datasets", views.DatasetViewSet, basename="dataset")
router.register("models", views.ModelDefinitionViewSet, basename="model")
router.register("jobs", views.JobViewSet, basename="job")
router.register("hpo", hpo.HpoViewSet, basename="api-hpo")

urlpatterns = [
    path("auth/token/", views.obtain_token, name="api-token"),
    path("me/", views.me, name="api-me"),
    *router.urls,
]
