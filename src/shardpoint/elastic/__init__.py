"""Elastic training: keep the global batch and the sample sequence of a run when
it resumes on a different number of ranks.

``accumulation_steps`` says how many micro-batches each rank runs per optimizer
step; ``ElasticBatchSampler`` hands every rank its share of each global batch and
keeps a position that belongs to the job, so ``TrainState(data=sampler)`` can
restore it on any world size. See ``docs/elastic.md``.
"""

from __future__ import annotations

from .batch import accumulation_steps
from .sampler import ElasticBatchSampler

__all__ = ["accumulation_steps", "ElasticBatchSampler"]
