"""The keep-or-revert gate: the run's own steps timed compiled against eager (and each
candidate), and the one decision that the log line, the region report and a later
``validate``, ``test`` or ``predict`` read."""
