"""The scheduler: lookup, load, store and job rules, split by concern."""

from kvcore.scheduler.scheduler import OffloadScheduler
from kvcore.spec.errors import (
    ArgumentRangeError,
    ArgumentTypeError,
    BadReportError,
    BadStepError,
    BlockIdError,
    DuplicateRequestError,
    HashError,
    UnknownJobError,
    UnknownRequestError,
)
from kvcore.spec.hooks import (
    KeyEvent,
    LoadFailure,
    OutputResult,
    RequestInfo,
    ScheduledRequest,
    SchedulerStats,
    StepInput,
    StepPlan,
    WorkerReport,
)

__all__ = [
    "ArgumentRangeError",
    "ArgumentTypeError",
    "BadReportError",
    "BadStepError",
    "BlockIdError",
    "DuplicateRequestError",
    "HashError",
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
