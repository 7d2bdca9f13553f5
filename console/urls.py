from django.contrib.auth import views as auth_views
from django.urls import path

from console import views

urlpatterns = [
    path("", views.home, name="home"),
    path("hosts/", views.hosts, name="hosts"),
    path("resource-groups/", views.resource_groups, name="resource-groups"),
    path("resource-groups/new/", views.resource_group_edit, name="resource-group-new"),
    path("resource-groups/<int:pk>/edit/", views.resource_group_edit, name="resource-group-edit"),
    path("instance-groups/", views.instance_groups, name="instance-groups"),
    path("instance-groups/new/", views.instance_group_edit, name="instance-group-new"),
    path("instance-groups/<int:pk>/", views.instance_group_dashboard, name="instance-group"),
    path("instance-groups/<int:pk>/edit/", views.instance_group_edit, name="instance-group-edit"),
    path("instance-groups/<int:pk>/chart.json", views.instance_group_chart,
         name="instance-group-chart"),
    path("datasets/", views.datasets, name="datasets"),
    path("datasets/new/", views.dataset_new, name="dataset-new"),
    path("datasets/new/any/", views.dataset_new_any, name="dataset-new-any"),
    path("datasets/<int:pk>/delete/", views.dataset_delete, name="dataset-delete"),
    path("models/", views.models_list, name="models"),
    path("models/new/", views.model_new, name="model-new"),
    path("models/<int:pk>/delete/", views.model_delete, name="model-delete"),
    path("models/<int:model_id>/train/", views.train, name="model-train"),
    path("train/", views.train, name="train"),
    path("jobs/", views.jobs, name="jobs"),
    path("jobs/reorder/", views.jobs_reorder, name="jobs-reorder"),
    path("jobs/<int:pk>/", views.job_detail, name="job"),
    path("jobs/<int:pk>/history.json", views.job_history, name="job-history"),
    path("jobs/<int:pk>/priority/", views.job_priority, name="job-priority"),
    path("jobs/<int:pk>/stop/", views.job_stop, name="job-stop"),
    path("jobs/<int:pk>/results/", views.job_results, name="job-results"),
    path("jobs/<int:pk>/results/<path:path>", views.job_result_download, name="job-result"),
    # Not namespaced: settings.LOGIN_URL and LOGOUT_REDIRECT_URL name "login".
    path(
        "login/",
        auth_views.LoginView.as_view(redirect_authenticated_user=True),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
