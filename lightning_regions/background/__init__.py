"""The background compile: the switch in the training processes (``switch``), what
crosses to the child (``shipment``) and the child process itself (``child``)."""
