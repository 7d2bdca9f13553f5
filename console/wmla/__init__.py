"""WMLA compatibility: the ``/platform/rest/deeplearning/v1`` REST API and its logon tokens.

Notebooks and scripts written against IBM Watson Machine Learning Accelerator's deep-learning
REST API work here with only the host name changed. Every write goes through the same services
as ``/api/v1`` (``jobs.services``, ``models.services``), so permissions and validation are shared.
"""
