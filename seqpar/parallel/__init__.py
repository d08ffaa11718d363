"""The parallel attention algorithms, as plain forward/backward functions (no autograd).

- :mod:`.merge`: merging partial results by their log-sum-exp, and attention sinks;
- :mod:`.ring`: the one ring driver that executes a :class:`~seqpar.placement.RingPlan`;
- :mod:`.ulysses`: the all-to-all head/sequence exchange, and Ulysses around the ring;
- :mod:`.replicated`: queries replicated on every rank (joint text tokens) over sharded keys;
- :mod:`.hybrid`: the one composition of a call, run by eager and compiled code alike
  (Note [Hybrid composition]).
"""
