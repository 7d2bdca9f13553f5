"""A job's priority: its bounds and default, in one place for the models, the forms, the API
and the scheduler's policy (which must not import Django, so this module does not either)."""

MIN = 1
MAX = 10000
DEFAULT = 5000
