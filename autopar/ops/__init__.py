"""The instruction set at the bottom: communicators, collectives, local ops and the
functions a pipeline stage program calls. Sharding rules, passes and the runtime all use
them; they import nothing of autopar but ``placement`` and ``device``."""
