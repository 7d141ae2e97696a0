"""The scheduler: lookup, load, store and job rules, split by concern."""

from kvcore.scheduler._types import (
    BadReportError,
    BadStepError,
    KeyEvent,
    LoadFailure,
    OutputResult,
    RequestInfo,
    ScheduledRequest,
    SchedulerStats,
    StepInput,
    StepPlan,
    UnknownJobError,
    UnknownRequestError,
    WorkerReport,
)
from kvcore.scheduler.scheduler import OffloadScheduler

__all__ = [
    "BadReportError",
    "BadStepError",
    "KeyEvent",
    "LoadFailure",
    "OffloadScheduler",
    "OutputResult",
    "RequestInfo",
    "ScheduledRequest",
    "SchedulerStats",
    "StepInput",
    "StepPlan",
    "UnknownJobError",
    "UnknownRequestError",
    "WorkerReport",
]
