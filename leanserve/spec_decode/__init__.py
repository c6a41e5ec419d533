"""Speculative decoding: proposers of draft tokens and the policy that decides how many to verify.

* :mod:`.ngram` -- prompt lookup (Saxena 2023): drafts copied from where the request's latest tokens occurred
  before in its own prompt and output.
* :mod:`.policy` -- per-request acceptance rates and the measured cost of verifying extra rows: how many drafts
  each request verifies in a step (none when speculation does not pay).

Verification itself is in :mod:`leanserve.worker.rejection_sampler` and the model runner.
"""
