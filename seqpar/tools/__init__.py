"""The tools around the library: benchmarks' helpers, test harnesses, measurement, tiny models.

Nothing here is imported by ``import seqpar``; import the module you need:

- :mod:`.testing`: ``DistPool``, functions run on local gloo ranks (tests, examples);
- :mod:`.profiling`: time and peak memory of an operation on any device, collective counts;
- :mod:`.one_rank`: one rank of a ring x Ulysses job alone in a process (Note [One-rank runs]);
- :mod:`.longest`: one rank of a Llama-shaped decoder stack and its peak memory (``scripts/bench_longest.py``);
- :mod:`.demo`: ``python -m seqpar demo``;
- :mod:`.check`: ``python -m seqpar check``, every mode against one device on a cluster, links, a recommendation;
- :mod:`.models`: tiny reference models (a video DiT, small ``transformers`` configs, tiny diffusers pipelines);
- :mod:`.bench`: what the benchmarks under ``scripts/`` share: launching ranks, inputs, warnings;
- :mod:`.report`: their output: tables, the JSON line, ``--plot`` charts, readable ``--help``;
- :mod:`.train_harness`: what ``scripts/train_*.py`` share: launch, loop, ``--check``, plot;
- :mod:`.torchvision_stub`: ``import_timm()``, timm where no torchvision works (a CPU-only torch).
"""
