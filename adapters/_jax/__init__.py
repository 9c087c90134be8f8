"""What the two JAX backends (``adapters/jax_pmap/``, ``adapters/jax_pjit/``) share.

``runtime.py`` starts JAX for the launch (``jax.distributed``, CPU device count, host
collectives); ``strategy.py`` is the host side of every JAX strategy (optimizer build and
update, step counting, checkpoint state); ``flat_units.py`` the flat per-unit buffers the
sharded strategies keep, ``tensor_parallel.py`` the GPT split over a ``model`` axis;
``stages.py`` cuts a model into pipeline stages, ``rounds.py`` turns a schedule into lockstep
rounds, ``programs.py`` compiles a stage's forward, backward and update, and ``pipeline.py`` is
the pipeline strategy both backends specialise. ``models/`` builds Flax modules from the
toolkit's specs. Importing this package imports no framework.
"""
