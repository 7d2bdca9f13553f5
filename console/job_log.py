"""A job's whole log, a page at a time: from its first line on, searched on the server over
the whole file (not only the tail the job page keeps), for the driver or one worker.

Pages are byte offsets into the log file (``events.logs.read_log_from``): the next page of a
long log, or of a search in it, costs what it reads, not what came before."""

from __future__ import annotations

from django import forms
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from console import selectors

PAGE_LINES = 500


class LogPageForm(forms.Form):
    offset = forms.IntegerField(min_value=0, required=False)
    source = forms.CharField(max_length=200, required=False)
    q = forms.CharField(label="Search", max_length=200, required=False, strip=False)


@login_required
def job_log_page(request: HttpRequest, pk: int) -> HttpResponse:
    job = get_object_or_404(selectors.jobs_for_user(user=request.user), pk=pk)
    form = LogPageForm(request.GET)
    asked = form.cleaned_data if form.is_valid() else {}
    offset, source, query = asked.get("offset") or 0, asked.get("source", ""), asked.get("q", "")
    lines, next_offset = [], None
    if form.is_valid():
        lines, next_offset = selectors.job_log_page(job=job, offset=offset, limit=PAGE_LINES,
                                                    source=source, query=query)
    return render(request, "console/job_log.html", {
        "job": job, "form": form, "lines": lines, "offset": offset, "next_offset": next_offset,
        "sources": selectors.job_log_sources(job=job), "source": source, "q": query,
    })
