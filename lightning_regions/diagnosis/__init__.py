"""Judge and report: every judgement of what torch did with its fix text (``judge``),
the region report that assembles and formats them (``report``), and the tie check."""
