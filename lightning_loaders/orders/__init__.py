"""Orders: which dataset index sits at each position of an epoch, as a pure function of
``(seed, epoch, position)`` (the first step of the data flow)."""
