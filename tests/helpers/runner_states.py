"""The runner's request states (backend/engine/runner/request_state.py) for steps a test
builds by hand: each scheduled request as the runner would first get it."""

from typing import Sequence

import torch

from backend.engine.runner.request_state import RequestState, RequestStates
from backend.engine.scheduling.sched_output import ScheduledRequest, SchedulerOutput


def states_of(scheduled: Sequence[ScheduledRequest], device: torch.device = torch.device("cpu")
              ) -> list[RequestState]:
    return RequestStates(device).apply(SchedulerOutput.first_step(list(scheduled)))
