"""The save pipeline, one module per step:

    describe -> arrive -> coordinate -> stage -> write -> commit -> after-commit

:mod:`.pipeline` runs it (blocking, asynchronous and overlapped saves are the same
path); :mod:`.records` holds what the steps hand each other; :mod:`.coordinator`
is rank 0's planner; :mod:`.offline` drives the same steps for N simulated ranks
from one process (converters); :mod:`.incremental` decides which chunks an
incremental save refers to instead of writing.
"""
