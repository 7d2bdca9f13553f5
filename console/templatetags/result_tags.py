"""Template helpers for a job's result files and checkpoints (``console.job_files``)."""

from __future__ import annotations

from django import template

from console import job_files

register = template.Library()


@register.simple_tag
def result_tree(results: list) -> job_files.Folder:
    """``{% result_tree results as tree %}``: the flat list of result files as a tree."""
    return job_files.result_tree(results)


@register.simple_tag
def job_checkpoints(job) -> list[job_files.Checkpoint]:
    """``{% job_checkpoints job as checkpoints %}``: the job's checkpoints, newest first."""
    return job_files.job_checkpoints(job)
