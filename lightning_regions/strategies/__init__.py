"""Lightning and Fabric glue: the Trainer strategies (``trainer``), FSDP2's (``fsdp``),
FSDP1's and DeepSpeed's (``wrapping``), Fabric's (``fabric``), any strategy class
(``compose``), and the parts each strategy owns (``environment``, ``first_step``)."""
