"""The parallel attention layers: LSE merge, the ring driver, Ulysses, replicated tokens.

- :mod:`.merge`: merging partial results by their log-sum-exp, and attention sinks;
- :mod:`.ring`: the one ring driver that executes a :class:`~seqpar.placement.RingPlan`;
- :mod:`.ulysses`: the all-to-all head/sequence exchange around an inner attention;
- :mod:`.replicated`: queries replicated on every rank (joint text tokens) over sharded keys.
"""
