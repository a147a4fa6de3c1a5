"""The jobs `distbench launch` may run. Followers read job names from torchrun's store, which anyone who can
reach its port can write, so a launch runs only these, each with arguments checked against its own
signature (runtime/jobspec.py): what parity (train, reference_job) and `distbench run` (bench, trace) send."""

from __future__ import annotations

from ..runtime.jobspec import JobRegistry
from .bench import bench, trace
from .checks import reference_job
from .train import train

LAUNCH_JOBS = JobRegistry([train, reference_job, bench, trace])
