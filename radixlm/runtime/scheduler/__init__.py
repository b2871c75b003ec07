"""Continuous-batching scheduler and its queue policies (no torch)."""

from radixlm.runtime.scheduler.policy import POLICIES
from radixlm.runtime.scheduler.request import ProgramTag, Request, Status
from radixlm.runtime.scheduler.scheduler import GraphRoom, Scheduled, Scheduler

__all__ = ["POLICIES", "GraphRoom", "ProgramTag", "Request", "Scheduled", "Scheduler", "Status"]
